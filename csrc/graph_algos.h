// Graph algorithms behind rannc._C: plain C++ over std::vector, no Python types,
// so they can run with the GIL released. Node ids are 0..n-1; an edge (a, b)
// means b depends on a. Bad input throws std::invalid_argument (pybind11
// turns it into ValueError).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace rannc {

using Edge = std::pair<int64_t, int64_t>;
using EdgeList = std::vector<Edge>;

// Kahn's algorithm popping the smallest ready node, so the result is the
// lexicographically smallest topological order (an ordered graph keeps its order).
std::vector<int64_t> topological_order(int64_t n, const EdgeList& edges);

// Which nodes are reachable from `sources` along edges (sources included).
std::vector<bool> forward_reachable(int64_t n, const EdgeList& edges,
                                    const std::vector<int64_t>& sources);

// The first edge (in the given order) going from a later group to an earlier
// one, or nullopt if the ordered grouping can run stage after stage.
std::optional<Edge> check_ordered_groups(int64_t n, const EdgeList& edges,
                                         const std::vector<int64_t>& group_of);

// The sorted, de-duplicated group-to-group edges between different groups.
EdgeList group_dag_edges(const EdgeList& edges, const std::vector<int64_t>& group_of);

}  // namespace rannc
