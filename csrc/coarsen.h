// Phase 2 (paper III-B): k-way multilevel coarsening of atomic components into
// blocks. Plain C++ over std::vector (no Python types) so it runs with the GIL
// released. See rannc/coarsen/ for the Python side and the reference.
#pragma once

#include <pybind11/pybind11.h>

namespace rannc {

// Registers the coarsening functions on the rannc._C module.
void bind_coarsen(pybind11::module_& m);

}  // namespace rannc
