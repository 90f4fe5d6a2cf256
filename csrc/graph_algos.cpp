#include "graph_algos.h"

#include <algorithm>
#include <functional>
#include <queue>
#include <stdexcept>
#include <string>

namespace rannc {
namespace {

// Rejects a negative node count early, before anything is sized by it.
void check_count(int64_t n) {
    if (n < 0) {
        throw std::invalid_argument("the node count must be >= 0, got " + std::to_string(n));
    }
}

// Names the first edge with an endpoint outside 0..n-1: indexing with it would
// read or write out of bounds, and the message lets the caller find it.
void check_edges(int64_t n, const EdgeList& edges) {
    for (size_t k = 0; k < edges.size(); ++k) {
        const auto [a, b] = edges[k];
        if (a < 0 || a >= n || b < 0 || b >= n) {
            throw std::invalid_argument("edge " + std::to_string(k) + " (" + std::to_string(a) +
                                        ", " + std::to_string(b) + ") has a node outside 0.." +
                                        std::to_string(n - 1) + " (n = " + std::to_string(n) +
                                        ")");
        }
    }
}

// Successor lists in compressed (CSR) form: one allocation for all nodes
// instead of one vector per node, which matters at ~1M edges. Successors keep
// the order of the edge list.
struct Csr {
    std::vector<int64_t> start;  // successors of i are succ[start[i] .. start[i+1])
    std::vector<int64_t> succ;
};

Csr build_csr(int64_t n, const EdgeList& edges) {
    Csr g;
    g.start.assign(static_cast<size_t>(n) + 1, 0);
    for (const auto& [a, b] : edges) ++g.start[a + 1];
    for (int64_t i = 0; i < n; ++i) g.start[i + 1] += g.start[i];
    g.succ.resize(edges.size());
    std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
    for (const auto& [a, b] : edges) g.succ[fill[a]++] = b;
    return g;
}

}  // namespace

// Kahn's algorithm with a min-heap of ready nodes: always taking the smallest
// ready index makes the order unique and keeps an already ordered graph as is.
// O(n + e log n). A cycle leaves nodes that never become ready.
std::vector<int64_t> topological_order(int64_t n, const EdgeList& edges) {
    check_count(n);
    check_edges(n, edges);
    const Csr g = build_csr(n, edges);
    std::vector<int64_t> indeg(n, 0);
    for (const auto& [a, b] : edges) ++indeg[b];

    std::vector<int64_t> ready;
    for (int64_t i = 0; i < n; ++i) {
        if (indeg[i] == 0) ready.push_back(i);
    }
    std::priority_queue<int64_t, std::vector<int64_t>, std::greater<int64_t>> heap(
        std::greater<int64_t>(), std::move(ready));

    std::vector<int64_t> order;
    order.reserve(n);
    while (!heap.empty()) {
        const int64_t i = heap.top();
        heap.pop();
        order.push_back(i);
        for (int64_t k = g.start[i]; k < g.start[i + 1]; ++k) {
            const int64_t j = g.succ[k];
            if (--indeg[j] == 0) heap.push(j);
        }
    }
    if (static_cast<int64_t>(order.size()) != n) {
        throw std::invalid_argument("the graph has a cycle: " +
                                    std::to_string(n - static_cast<int64_t>(order.size())) +
                                    " of " + std::to_string(n) + " nodes are on or after one");
    }
    return order;
}

// Iterative depth-first search (an explicit stack, so deep chains cannot
// overflow the C++ stack); each node is pushed at most once, O(n + e).
std::vector<bool> forward_reachable(int64_t n, const EdgeList& edges,
                                    const std::vector<int64_t>& sources) {
    check_count(n);
    check_edges(n, edges);
    for (size_t k = 0; k < sources.size(); ++k) {
        if (sources[k] < 0 || sources[k] >= n) {
            throw std::invalid_argument("source " + std::to_string(k) + " (" +
                                        std::to_string(sources[k]) + ") is outside 0.." +
                                        std::to_string(n - 1) + " (n = " + std::to_string(n) +
                                        ")");
        }
    }
    const Csr g = build_csr(n, edges);
    std::vector<bool> seen(n, false);
    std::vector<int64_t> stack;
    for (const int64_t s : sources) {
        if (!seen[s]) {
            seen[s] = true;
            stack.push_back(s);
        }
    }
    while (!stack.empty()) {
        const int64_t i = stack.back();
        stack.pop_back();
        for (int64_t k = g.start[i]; k < g.start[i + 1]; ++k) {
            const int64_t j = g.succ[k];
            if (!seen[j]) {
                seen[j] = true;
                stack.push_back(j);
            }
        }
    }
    return seen;
}

// Groups run in their numbered order, so a grouping is executable stage after
// stage (and each group convex) exactly when no edge points to an earlier
// group. Returns the first offending edge so the caller can report it. O(e).
std::optional<Edge> check_ordered_groups(int64_t n, const EdgeList& edges,
                                         const std::vector<int64_t>& group_of) {
    check_count(n);
    if (static_cast<int64_t>(group_of.size()) != n) {
        throw std::invalid_argument("group_of has " + std::to_string(group_of.size()) +
                                    " entries for " + std::to_string(n) + " nodes");
    }
    check_edges(n, edges);
    for (const auto& e : edges) {
        if (group_of[e.first] > group_of[e.second]) return e;
    }
    return std::nullopt;
}

// The quotient graph of a grouping: one edge per pair of distinct groups that
// some node edge connects, sorted so the result is deterministic. O(e log e).
EdgeList group_dag_edges(const EdgeList& edges, const std::vector<int64_t>& group_of) {
    const auto n = static_cast<int64_t>(group_of.size());
    check_edges(n, edges);
    EdgeList out;
    for (const auto& [a, b] : edges) {
        if (group_of[a] != group_of[b]) out.emplace_back(group_of[a], group_of[b]);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

}  // namespace rannc
