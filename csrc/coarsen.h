// Phase 2 (paper III-B): k-way multilevel coarsening of atomic components into
// blocks. Plain C++ over std::vector (no Python types) so it runs with the GIL
// released. See rannc/coarsen/ for the Python side and the reference
// (rannc/coarsen/reference.py), which this must match decision for decision.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace rannc {

// One data value: (producer, consumers, bytes). Consumers must be > producer.
using CoarsenValue = std::tuple<int64_t, std::vector<int64_t>, double>;

// block_of[c] for each atomic component c in 0..n-1 (index order is a
// topological order). Blocks are numbered in a topological order of the block
// graph. `uncoarsen` = false skips the uncoarsening step (for comparisons).
// Throws std::invalid_argument on malformed input.
std::vector<int64_t> form_blocks(int64_t n, const std::vector<CoarsenValue>& values,
                                 const std::vector<double>& time,
                                 const std::vector<double>& memory, double mem_limit,
                                 int64_t k, bool uncoarsen);

// Registers the coarsening functions on the rannc._C module.
void bind_coarsen(pybind11::module_& m);

}  // namespace rannc
