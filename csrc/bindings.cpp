// Python bindings for rannc._C. Arguments are converted to std::vector while
// the GIL is held; the algorithms then run with it released (call_guard), and
// the results are converted back after it is re-acquired.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "coarsen.h"
#include "graph_algos.h"
#include "stage_dp.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "Native graph algorithms for rannc's planner (see rannc.graph.native).";

    m.def("topological_order", &rannc::topological_order, py::arg("n"), py::arg("edges"),
          py::call_guard<py::gil_scoped_release>(),
          "Kahn's algorithm, smallest ready index first; ValueError on a cycle or a bad edge.");

    m.def("forward_reachable", &rannc::forward_reachable, py::arg("n"), py::arg("edges"),
          py::arg("sources"), py::call_guard<py::gil_scoped_release>(),
          "Which nodes are reachable from `sources` (sources included).");

    m.def("check_ordered_groups", &rannc::check_ordered_groups, py::arg("n"), py::arg("edges"),
          py::arg("group_of"), py::call_guard<py::gil_scoped_release>(),
          "None if no edge goes to an earlier group, else the first such edge (a, b).");

    m.def("group_dag_edges", &rannc::group_dag_edges, py::arg("edges"), py::arg("group_of"),
          py::call_guard<py::gil_scoped_release>(),
          "Sorted, de-duplicated (group_of[a], group_of[b]) for edges between different groups.");

    rannc::bind_coarsen(m);
    rannc::bind_stage_dp(m);
}
