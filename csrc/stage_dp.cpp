// Algorithm 1 of the paper as an exact min-max dynamic program.
//
// The paper's recurrence keeps, per state, the pair (slowest forward, slowest
// backward) that minimises their sum; that pair is not optimal substructure
// (a worse sum now can combine into a better sum later), so it can miss the
// optimum. We minimise the slowest stage's time h = forward + backward +
// communication instead, which decomposes exactly:
//   E[s][b][d] = min over b' < b, d' < d of max(E[s-1][b'][d'], h[b'][b-1][d-d'])
// where E[s][b][d] is the best bottleneck for the first b blocks as s stages on
// d devices. One run fills E for every stage count up to s_max, so the caller
// reads off the optimum for each S without re-running.
#include "stage_dp.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace rannc {
namespace py = pybind11;
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct StageSolution {
    double value;                        // the slowest stage's h (inf: infeasible)
    std::vector<int64_t> bounds;         // S+1 block boundaries, 0 .. k
    std::vector<int64_t> replicas;       // S device counts, summing to the devices
};

// h is laid out as h[(l * k + r) * (devices + 1) + d]: stage of blocks l..r
// (inclusive) on d replicas; inf where it does not fit.
std::vector<StageSolution> stage_dp(int64_t k, int64_t devices, int64_t s_max,
                                    const std::vector<double>& h) {
    if (k < 1 || devices < 1 || s_max < 1) {
        throw std::invalid_argument("stage_dp needs k >= 1, devices >= 1 and s_max >= 1; got k=" +
                                    std::to_string(k) + ", devices=" + std::to_string(devices) +
                                    ", s_max=" + std::to_string(s_max));
    }
    const int64_t D1 = devices + 1;
    if (static_cast<int64_t>(h.size()) != k * k * D1) {
        throw std::invalid_argument("the cost table has " + std::to_string(h.size()) +
                                    " entries; k*k*(devices+1) = " + std::to_string(k * k * D1));
    }
    const int64_t S = std::min({s_max, k, devices});
    const int64_t K1 = k + 1;
    auto at = [&](int64_t s, int64_t b, int64_t d) { return (s * K1 + b) * D1 + d; };
    std::vector<double> E(static_cast<size_t>((S + 1) * K1 * D1), kInf);
    std::vector<int32_t> from_b(E.size(), -1), from_d(E.size(), -1);
    E[at(0, 0, 0)] = 0.0;
    for (int64_t s = 1; s <= S; ++s) {
        for (int64_t b = s; b <= k; ++b) {
            for (int64_t d = s; d <= devices; ++d) {
                double best = kInf;
                int32_t bb = -1, bd = -1;
                for (int64_t bp = s - 1; bp < b; ++bp) {
                    const double* hrow = &h[static_cast<size_t>((bp * k + (b - 1)) * D1)];
                    for (int64_t dp = s - 1; dp < d; ++dp) {
                        const double prev = E[at(s - 1, bp, dp)];
                        if (prev >= best) continue;  // cannot improve: max(prev, .) >= best
                        const double cur = hrow[d - dp];
                        const double v = prev > cur ? prev : cur;
                        if (v < best) {
                            best = v;
                            bb = static_cast<int32_t>(bp);
                            bd = static_cast<int32_t>(dp);
                        }
                    }
                }
                E[at(s, b, d)] = best;
                from_b[at(s, b, d)] = bb;
                from_d[at(s, b, d)] = bd;
            }
        }
    }
    std::vector<StageSolution> out;
    for (int64_t s = 1; s <= s_max; ++s) {
        StageSolution sol{kInf, {}, {}};
        if (s <= S && E[at(s, k, devices)] < kInf) {
            sol.value = E[at(s, k, devices)];
            sol.bounds.assign(static_cast<size_t>(s + 1), 0);
            sol.replicas.assign(static_cast<size_t>(s), 0);
            int64_t b = k, d = devices;
            for (int64_t i = s; i >= 1; --i) {
                const int64_t pb = from_b[at(i, b, d)], pd = from_d[at(i, b, d)];
                sol.bounds[static_cast<size_t>(i)] = b;
                sol.replicas[static_cast<size_t>(i - 1)] = d - pd;
                b = pb;
                d = pd;
            }
        }
        out.push_back(std::move(sol));
    }
    return out;
}

// The same min-max DP with a cost table per stage position, counted from the END of the
// pipeline: stage j-th from the end (the last stage: j = 1) is costed with
// tables[table_of[j - 1]]. A 1F1B stage j-th from the end holds min(j, M) microbatches in
// flight, so its memory (and the recomputation it needs to fit) depends on j, which a prefix
// DP cannot know while S is open; over the blocks reversed, the stage being added is always
// the j-th from the end:
//   F[j][b][d] = min over b' > b, d' < d of max(F[j-1][b'][d'], h_j[b][b'-1][d-d'])
// where F[j][b][d] is the best bottleneck for blocks b..k-1 as j stages on d devices.
std::vector<StageSolution> stage_dp_by_position(int64_t k, int64_t devices, int64_t s_max,
                                                const std::vector<double>& tables,
                                                const std::vector<int64_t>& table_of) {
    if (k < 1 || devices < 1 || s_max < 1) {
        throw std::invalid_argument("stage_dp_by_position needs k >= 1, devices >= 1 and s_max >= 1; got k=" +
                                    std::to_string(k) + ", devices=" + std::to_string(devices) +
                                    ", s_max=" + std::to_string(s_max));
    }
    const int64_t D1 = devices + 1;
    const int64_t one = k * k * D1;
    if (static_cast<int64_t>(tables.size()) % one != 0 || tables.empty()) {
        throw std::invalid_argument("the cost tables hold " + std::to_string(tables.size()) +
                                    " entries, not a positive multiple of k*k*(devices+1) = " +
                                    std::to_string(one));
    }
    const int64_t n_tables = static_cast<int64_t>(tables.size()) / one;
    if (static_cast<int64_t>(table_of.size()) < std::min({s_max, k, devices})) {
        throw std::invalid_argument("table_of names a table for " + std::to_string(table_of.size()) +
                                    " positions; the stage counts go up to " +
                                    std::to_string(std::min({s_max, k, devices})));
    }
    for (const int64_t t : table_of) {
        if (t < 0 || t >= n_tables) {
            throw std::invalid_argument("table_of holds " + std::to_string(t) + "; there are " +
                                        std::to_string(n_tables) + " tables");
        }
    }
    const int64_t S = std::min({s_max, k, devices});
    const int64_t K1 = k + 1;
    auto at = [&](int64_t j, int64_t b, int64_t d) { return (j * K1 + b) * D1 + d; };
    std::vector<double> F(static_cast<size_t>((S + 1) * K1 * D1), kInf);
    std::vector<int32_t> to_b(F.size(), -1), to_d(F.size(), -1);
    F[at(0, k, 0)] = 0.0;
    for (int64_t j = 1; j <= S; ++j) {
        const double* h = &tables[static_cast<size_t>(table_of[static_cast<size_t>(j - 1)] * one)];
        for (int64_t b = k - j; b >= 0; --b) {
            for (int64_t d = j; d <= devices; ++d) {
                double best = kInf;
                int32_t nb = -1, nd = -1;
                for (int64_t bn = b + 1; bn <= k - (j - 1); ++bn) {
                    const double* hrow = &h[static_cast<size_t>((b * k + (bn - 1)) * D1)];
                    for (int64_t dn = j - 1; dn < d; ++dn) {
                        const double rest = F[at(j - 1, bn, dn)];
                        if (rest >= best) continue;  // cannot improve: max(rest, .) >= best
                        const double cur = hrow[d - dn];
                        const double v = rest > cur ? rest : cur;
                        if (v < best) {
                            best = v;
                            nb = static_cast<int32_t>(bn);
                            nd = static_cast<int32_t>(dn);
                        }
                    }
                }
                F[at(j, b, d)] = best;
                to_b[at(j, b, d)] = nb;
                to_d[at(j, b, d)] = nd;
            }
        }
    }
    std::vector<StageSolution> out;
    for (int64_t s = 1; s <= s_max; ++s) {
        StageSolution sol{kInf, {}, {}};
        if (s <= S && F[at(s, 0, devices)] < kInf) {
            sol.value = F[at(s, 0, devices)];
            sol.bounds.push_back(0);
            int64_t b = 0, d = devices;
            for (int64_t j = s; j >= 1; --j) {
                const int64_t nb = to_b[at(j, b, d)], nd = to_d[at(j, b, d)];
                sol.bounds.push_back(nb);
                sol.replicas.push_back(d - nd);
                b = nb;
                d = nd;
            }
        }
        out.push_back(std::move(sol));
    }
    return out;
}

py::list solutions_to_python(const std::vector<StageSolution>& sols) {
    py::list out;
    for (const auto& s : sols) {
        out.append(py::make_tuple(s.value, s.bounds, s.replicas));
    }
    return out;
}

}  // namespace

void bind_stage_dp(pybind11::module_& m) {
    m.def(
        "stage_dp",
        [](int64_t k, int64_t devices, int64_t s_max, const std::vector<double>& h) {
            std::vector<StageSolution> sols;
            {
                py::gil_scoped_release release;
                sols = stage_dp(k, devices, s_max, h);
            }
            return solutions_to_python(sols);
        },
        py::arg("k"), py::arg("devices"), py::arg("s_max"), py::arg("h"),
        "Min-max stage DP: for S = 1..s_max, (bottleneck, block bounds, replicas); "
        "bottleneck inf when S stages do not fit. h[(l*k + r)*(devices+1) + d] is the time "
        "of blocks l..r on d replicas.");
    m.def(
        "stage_dp_by_position",
        [](int64_t k, int64_t devices, int64_t s_max, const std::vector<double>& tables,
           const std::vector<int64_t>& table_of) {
            std::vector<StageSolution> sols;
            {
                py::gil_scoped_release release;
                sols = stage_dp_by_position(k, devices, s_max, tables, table_of);
            }
            return solutions_to_python(sols);
        },
        py::arg("k"), py::arg("devices"), py::arg("s_max"), py::arg("tables"), py::arg("table_of"),
        "stage_dp with a cost table per stage position counted from the end: the j-th stage "
        "from the end (last: j = 1) is costed with table table_of[j-1] of the concatenated "
        "k*k*(devices+1) tables.");
}

}  // namespace rannc
