// Block formation (paper III-B): coarsening, uncoarsening, compaction.
//
// The rules are stated once, in rannc/coarsen/reference.py, and this file must
// reach the same grouping decision for decision; the comments here explain how
// it gets there fast. In short:
//
// - A grouping is valid when the graph between its groups (the quotient) is
//   acyclic: then every group is convex and the groups can run in order.
//   Every level of the coarsening keeps a topological order of its quotient
//   (`Level::order`), so "would merging v and w make a cycle?" becomes "is
//   there a path of length >= 2 from the earlier to the later one?", a search
//   that never leaves the positions between them. After a merge, the nodes in
//   that range are reordered so the order stays topological (as in
//   Pearce-Kelly's dynamic topological sort).
// - Sums of floats are taken in the same order as the reference, and decisions
//   compare bytes (not bytes / bandwidth) using additions only, so no product
//   can be fused into an FMA and round differently from Python.
//
// Index conventions: c, d index components (0..n-1, a topological order);
// i indexes values; g, s, t, v, w name groups of one level; L is a level
// (level 0 has one group per component; level L + 1 merges pairs of level L).
#include "coarsen.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <queue>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

namespace py = pybind11;

namespace rannc {
namespace {

using Index = int64_t;
using Pairs = std::vector<std::pair<Index, Index>>;

// Adjacency in compressed form; row r is item[start[r] .. start[r + 1]).
struct Csr {
    std::vector<Index> start;
    std::vector<Index> item;
    const Index* begin(Index r) const { return item.data() + start[r]; }
    const Index* end(Index r) const { return item.data() + start[r + 1]; }
};

// Rows keep the order of `pairs` (sort them first for sorted rows).
Csr build_csr(Index rows, const Pairs& pairs) {
    Csr g;
    g.start.assign(static_cast<size_t>(rows) + 1, 0);
    for (const auto& pr : pairs) ++g.start[pr.first + 1];
    for (Index r = 0; r < rows; ++r) g.start[r + 1] += g.start[r];
    g.item.resize(pairs.size());
    std::vector<Index> fill(g.start.begin(), g.start.end() - 1);
    for (const auto& [a, b] : pairs) g.item[fill[a]++] = b;
    return g;
}

void sort_unique(Pairs& pairs) {
    std::sort(pairs.begin(), pairs.end());
    pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
}

Pairs reversed(const Pairs& pairs) {
    Pairs out;
    out.reserve(pairs.size());
    for (const auto& [a, b] : pairs) out.emplace_back(b, a);
    sort_unique(out);
    return out;
}

// Visited marks cleared in O(1): a mark counts only if it equals the epoch.
class Marks {
   public:
    void reset(size_t size) {
        if (mark_.size() < size) mark_.resize(size, 0);
        if (++epoch_ == 0) {  // wrapped around: old marks could look current
            std::fill(mark_.begin(), mark_.end(), 0);
            epoch_ = 1;
        }
    }
    bool test(Index i) const { return mark_[i] == epoch_; }
    // Marks i; false if it was already marked.
    bool set(Index i) {
        if (mark_[i] == epoch_) return false;
        mark_[i] = epoch_;
        return true;
    }

   private:
    std::vector<uint32_t> mark_;
    uint32_t epoch_ = 0;
};

struct Problem {
    Index n = 0;
    Index k = 1;
    double mem_limit = 0.0;
    const std::vector<double>* time = nullptr;
    const std::vector<double>* memory = nullptr;
    std::vector<Index> producer;  // per value
    Csr consumers;                // per value, as given
    std::vector<double> bytes;    // per value
    Pairs edges;                  // (producer, consumer), sorted, no repeats
    Csr succ, pred;               // over components, from `edges`
    Csr touches;                  // per component: ascending values it produces or reads
};

Problem make_problem(Index n, const std::vector<CoarsenValue>& values,
                     const std::vector<double>& time, const std::vector<double>& memory,
                     double mem_limit, Index k) {
    if (n < 0) throw std::invalid_argument("n must be >= 0, got " + std::to_string(n));
    if (static_cast<Index>(time.size()) != n || static_cast<Index>(memory.size()) != n) {
        throw std::invalid_argument("time has " + std::to_string(time.size()) +
                                    " entries and memory " + std::to_string(memory.size()) +
                                    " for n = " + std::to_string(n) + " components");
    }
    if (k < 1) throw std::invalid_argument("k must be >= 1, got " + std::to_string(k));
    if (std::isnan(mem_limit)) throw std::invalid_argument("mem_limit is NaN");
    Problem pb;
    pb.n = n;
    pb.k = k;
    pb.mem_limit = mem_limit;
    pb.time = &time;
    pb.memory = &memory;
    Pairs cons, touch;
    for (size_t i = 0; i < values.size(); ++i) {
        const auto& [p, cs, b] = values[i];
        if (p < 0 || p >= n) {
            throw std::invalid_argument("value " + std::to_string(i) + " has producer " +
                                        std::to_string(p) + " outside 0.." +
                                        std::to_string(n - 1));
        }
        pb.producer.push_back(p);
        pb.bytes.push_back(b);
        touch.emplace_back(p, static_cast<Index>(i));
        for (const Index c : cs) {
            if (c <= p || c >= n) {
                throw std::invalid_argument(
                    "value " + std::to_string(i) + " (producer " + std::to_string(p) +
                    ") has consumer " + std::to_string(c) +
                    ", which is not a component after its producer");
            }
            cons.emplace_back(static_cast<Index>(i), c);
            touch.emplace_back(c, static_cast<Index>(i));
            pb.edges.emplace_back(p, c);
        }
    }
    pb.consumers = build_csr(static_cast<Index>(values.size()), cons);
    sort_unique(touch);
    pb.touches = build_csr(n, touch);
    sort_unique(pb.edges);
    pb.succ = build_csr(n, pb.edges);
    pb.pred = build_csr(n, reversed(pb.edges));
    return pb;
}

// One level of the coarsening. Group ids are 0..count-1, in a topological order
// when the level is formed; uncoarsening then moves members between groups and
// keeps `order`/`pos` topological.
struct Level {
    Index count = 0;
    std::vector<Index> group_of;               // per component
    std::vector<std::vector<Index>> members;   // per group, ascending
    std::vector<Index> order;                  // slot -> group
    std::vector<Index> pos;                    // group -> slot
    Pairs pairs;  // (initiator, partner) merged into one group of the next level, in merge order
};

// Per-group sums used while coarsening (pairwise sums, as in the reference).
struct Stats {
    std::vector<double> time, mem;
    std::vector<Index> first;  // smallest member: the tie-breaker
};

void fill_members(Level& lv, Index n) {
    lv.members.assign(lv.count, {});
    for (Index c = 0; c < n; ++c) lv.members[lv.group_of[c]].push_back(c);
    lv.order.resize(lv.count);
    std::iota(lv.order.begin(), lv.order.end(), 0);
    lv.pos = lv.order;
}

// The quotient graph of `group_of`: sorted, de-duplicated group edges.
Pairs quotient_edges(const Problem& pb, const std::vector<Index>& group_of) {
    Pairs out;
    for (const auto& [a, b] : pb.edges) {
        if (group_of[a] != group_of[b]) out.emplace_back(group_of[a], group_of[b]);
    }
    sort_unique(out);
    return out;
}

// ---------------------------------------------------------------- coarsening

// Merges pairs of groups of `lv` (recording them in lv.pairs) and builds the next
// level; false if nothing could be merged. `count` is the number of groups so far.
bool coarsen_level(const Problem& pb, Level& lv, const Stats& st, Index& count, Level& next,
                   Stats& next_st) {
    const Index G = lv.count;
    const Pairs qe = quotient_edges(pb, lv.group_of);
    const Csr gsucc = build_csr(G, qe);
    const Csr gpred = build_csr(G, reversed(qe));

    std::vector<Index> visit(G);
    std::iota(visit.begin(), visit.end(), 0);
    std::sort(visit.begin(), visit.end(), [&](Index a, Index b) {
        return std::make_pair(st.time[a], st.first[a]) < std::make_pair(st.time[b], st.first[b]);
    });

    // The quotient while this level is merged: a merged pair is one node named by
    // its initiator v (rep[w] = v, partner[v] = w); `order` may hold holes (-1).
    std::vector<Index> rep(G), partner(G, -1), order(G), pos(G);
    std::iota(rep.begin(), rep.end(), 0);
    std::iota(order.begin(), order.end(), 0);
    std::iota(pos.begin(), pos.end(), 0);
    std::vector<char> merged(G, 0);
    Marks seen;
    std::vector<Index> stack, between;

    // Merges v and w if no path of length >= 2 joins them (the quotient stays
    // acyclic). The search starts at the earlier of the two and visits only
    // positions before the later one: any path to it lies there.
    auto try_merge = [&](Index v, Index w) -> bool {
        const Index a = pos[v] < pos[w] ? v : w;
        const Index b = a == v ? w : v;
        const Index lo = pos[a], hi = pos[b];
        seen.reset(G);
        stack.clear();
        auto expand = [&](Index r, bool start) -> bool {
            for (const Index part : {r, partner[r]}) {
                if (part < 0) continue;
                for (const Index* s = gsucc.begin(part); s != gsucc.end(part); ++s) {
                    const Index q = rep[*s];
                    if (q == r) continue;
                    if (q == b) {
                        if (start) continue;  // the edge a -> b itself
                        return false;
                    }
                    if (pos[q] < hi && seen.set(q)) stack.push_back(q);
                }
            }
            return true;
        };
        expand(a, true);  // cannot fail: the edge a -> b is skipped
        while (!stack.empty()) {
            const Index r = stack.back();
            stack.pop_back();
            if (!expand(r, false)) return false;
        }
        // Reorder slots lo..hi: what a reaches must follow the merged node, the
        // rest (which may reach b) must precede it.
        between.clear();
        for (Index slot = lo + 1; slot < hi; ++slot) {
            if (order[slot] >= 0) between.push_back(order[slot]);
        }
        Index slot = lo;
        auto place = [&](Index q) {
            order[slot] = q;
            pos[q] = slot++;
        };
        for (const Index q : between) {
            if (!seen.test(q)) place(q);
        }
        place(v);
        for (const Index q : between) {
            if (seen.test(q)) place(q);
        }
        while (slot <= hi) order[slot++] = -1;
        rep[w] = v;
        partner[v] = w;
        merged[v] = merged[w] = 1;
        return true;
    };

    std::vector<std::tuple<double, Index, Index>> cands;  // (time of the union, first of w, w)
    for (const Index v : visit) {
        if (count <= pb.k) break;
        if (merged[v]) continue;
        cands.clear();
        for (const Csr* adj : {&gsucc, &gpred}) {
            for (const Index* s = adj->begin(v); s != adj->end(v); ++s) {
                const Index w = *s;
                if (!merged[w] && st.mem[v] + st.mem[w] <= pb.mem_limit) {
                    cands.emplace_back(st.time[v] + st.time[w], st.first[w], w);
                }
            }
        }
        std::sort(cands.begin(), cands.end());
        for (const auto& cand : cands) {
            const Index w = std::get<2>(cand);
            if (try_merge(v, w)) {
                lv.pairs.emplace_back(v, w);
                --count;
                break;
            }
        }
    }
    if (lv.pairs.empty()) return false;

    // The next level's ids follow the final order, so they start out topological.
    std::vector<Index> new_id(G, -1);
    Index m = 0;
    for (Index slot = 0; slot < G; ++slot) {
        if (order[slot] >= 0) new_id[order[slot]] = m++;
    }
    next.count = m;
    next.group_of.resize(pb.n);
    for (Index c = 0; c < pb.n; ++c) next.group_of[c] = new_id[rep[lv.group_of[c]]];
    fill_members(next, pb.n);
    next_st.time.assign(m, 0.0);
    next_st.mem.assign(m, 0.0);
    next_st.first.assign(m, 0);
    for (Index g = 0; g < G; ++g) {
        if (rep[g] != g) continue;
        const Index id = new_id[g], w = partner[g];
        next_st.time[id] = w >= 0 ? st.time[g] + st.time[w] : st.time[g];
        next_st.mem[id] = w >= 0 ? st.mem[g] + st.mem[w] : st.mem[g];
        next_st.first[id] = w >= 0 ? std::min(st.first[g], st.first[w]) : st.first[g];
    }
    return true;
}

std::vector<Level> coarsen(const Problem& pb) {
    std::vector<Level> levels(1);
    Level& l0 = levels[0];
    l0.count = pb.n;
    l0.group_of.resize(pb.n);
    std::iota(l0.group_of.begin(), l0.group_of.end(), 0);
    fill_members(l0, pb.n);
    Stats st{*pb.time, *pb.memory, l0.group_of};
    Index count = pb.n;
    while (count > pb.k) {
        Level next;
        Stats next_st;
        if (!coarsen_level(pb, levels.back(), st, count, next, next_st)) break;
        levels.push_back(std::move(next));
        st = std::move(next_st);
    }
    return levels;
}

// ------------------------------------------------------------- uncoarsening

// Moves one half of each merged pair into a neighbouring group when that sends
// fewer bytes between the groups of the level above (and, if the final groups
// change, between those), and propagates the move to every coarser level
// (paper III-B). A move x: s -> t at level L splits x off s
// (the graph H) and merges it into t; the quotient stays acyclic iff H has no
// cycle (edges both ways between x and s \ x) and no path of length >= 2 joins
// x and t in H, which a search bounded by the level's order decides.
class Refiner {
   public:
    Refiner(const Problem& pb, std::vector<Level>& levels) : pb_(pb), levels_(levels) {}

    void run() {
        const Index top = static_cast<Index>(levels_.size()) - 1;
        for (Index step = top - 1; step >= 0; --step) {
            for (const auto& [v, w] : levels_[step].pairs) refine_pair(step, v, w);
        }
    }

   private:
    struct Candidate {
        double gain;  // bytes after - bytes before (negative: fewer)
        int half;     // 0: the initiator moves, 1: the partner
        Index t_first;
        Index x;
    };
    // New contents of order[lo .. lo + seq.size()) at one level, and the move there.
    struct Plan {
        Index level, s, t, lo;
        std::vector<Index> seq;
    };

    const Problem& pb_;
    std::vector<Level>& levels_;
    Marks marks_, seen_;
    std::vector<Index> stack_, adj_, x_values_;
    std::vector<Candidate> cands_;
    std::vector<Plan> plans_;

    Index top() const { return static_cast<Index>(levels_.size()) - 1; }

    void refine_pair(Index step, Index v, Index w) {
        const Level& fine = levels_[step];
        const Level& up = levels_[step + 1];
        const Level& last = levels_[top()];
        const Index s = up.group_of[fine.members[v][0]];

        adj_.clear();  // groups of level step + 1 joined to s by a value
        marks_.reset(up.count);
        marks_.set(s);
        for (const Index c : up.members[s]) {
            for (const Csr* g : {&pb_.succ, &pb_.pred}) {
                for (const Index* d = g->begin(c); d != g->end(c); ++d) {
                    const Index t = up.group_of[*d];
                    if (marks_.set(t)) adj_.push_back(t);
                }
            }
        }

        cands_.clear();
        for (int half = 0; half < 2; ++half) {
            const Index x = half == 0 ? v : w;
            const Index x0 = fine.members[x][0];
            x_values_.clear();
            for (const Index c : fine.members[x]) {
                x_values_.insert(x_values_.end(), pb_.touches.begin(c), pb_.touches.end(c));
            }
            std::sort(x_values_.begin(), x_values_.end());
            x_values_.erase(std::unique(x_values_.begin(), x_values_.end()), x_values_.end());
            for (const Index t : adj_) {
                const auto [b1, a1] = comm_change(step + 1, step, x, t);
                if (!(a1 < b1)) continue;
                const Index t0 = up.members[t][0];
                const Index s_top = last.group_of[x0], t_top = last.group_of[t0];
                if (s_top != t_top) {
                    // The final groups change too: only for fewer bytes between them,
                    // not merely fewer one level up (that would reshuffle balanced
                    // blocks for nothing).
                    const auto [bt, at] = comm_change(top(), step, x, t_top);
                    if (!(at < bt)) continue;
                }
                cands_.push_back({a1 - b1, half, t0, x});
            }
        }
        std::sort(cands_.begin(), cands_.end(), [](const Candidate& a, const Candidate& b) {
            return std::make_tuple(a.gain, a.half, a.t_first) <
                   std::make_tuple(b.gain, b.half, b.t_first);
        });
        for (const Candidate& cand : cands_) {
            if (try_move(step, cand.x, cand.t_first)) break;
        }
    }

    // Bytes sent between the groups of `level` (before, after) over the values
    // touching x (a group of level `step`) when x moves to group t.
    std::pair<double, double> comm_change(Index level, Index step, Index x, Index t) {
        const Level& lv = levels_[level];
        const std::vector<Index>& fine_of = levels_[step].group_of;
        double before = 0.0, after = 0.0;
        for (const Index i : x_values_) {
            const Index p = pb_.producer[i];
            const Index gb = lv.group_of[p];
            const Index ga = fine_of[p] == x ? t : gb;
            marks_.reset(lv.count);
            marks_.set(gb);
            for (const Index* c = pb_.consumers.begin(i); c != pb_.consumers.end(i); ++c) {
                if (marks_.set(lv.group_of[*c])) before += pb_.bytes[i];
            }
            marks_.reset(lv.count);
            marks_.set(ga);
            for (const Index* c = pb_.consumers.begin(i); c != pb_.consumers.end(i); ++c) {
                if (marks_.set(fine_of[*c] == x ? t : lv.group_of[*c])) after += pb_.bytes[i];
            }
        }
        return {before, after};
    }

    // Memory of a ∪ b (both ascending), summed in ascending component order.
    bool fits(const std::vector<Index>& a, const std::vector<Index>& b) const {
        double total = 0.0;
        size_t i = 0, j = 0;
        while (i < a.size() || j < b.size()) {
            const Index c = (j == b.size() || (i < a.size() && a[i] < b[j])) ? a[i++] : b[j++];
            total += (*pb_.memory)[c];
        }
        return total <= pb_.mem_limit;
    }

    bool try_move(Index step, Index x, Index t0) {
        const Level& fine = levels_[step];
        const Index x0 = fine.members[x][0];
        plans_.clear();
        for (Index L = step + 1; L <= top(); ++L) {
            const Level& lv = levels_[L];
            const Index s = lv.group_of[x0], t = lv.group_of[t0];
            if (s == t) break;  // this and every coarser level already hold both
            if (!fits(lv.members[t], fine.members[x])) return false;
            plans_.push_back({L, s, t, 0, {}});
            if (!plan_level(step, x, plans_.back())) return false;
        }
        for (const Plan& plan : plans_) apply(step, x, plan);
        return true;
    }

    // Decides whether moving x: s -> t keeps level plan.level acyclic; if so,
    // fills in the reordered slots.
    bool plan_level(Index step, Index x, Plan& plan) {
        const Level& lv = levels_[plan.level];
        const Level& fine = levels_[step];
        const Index s = plan.s, t = plan.t;
        auto in_x = [&](Index c) { return fine.group_of[c] == x; };

        bool x_to_rest = false, rest_to_x = false;
        for (const Index c : fine.members[x]) {
            for (const Index* d = pb_.succ.begin(c); d != pb_.succ.end(c); ++d) {
                if (!in_x(*d) && lv.group_of[*d] == s) x_to_rest = true;
            }
            for (const Index* d = pb_.pred.begin(c); d != pb_.pred.end(c); ++d) {
                if (!in_x(*d) && lv.group_of[*d] == s) rest_to_x = true;
            }
        }
        if (x_to_rest && rest_to_x) return false;  // s \ x would need x on both sides

        // H: the level's quotient with x split off s as node X, placed just
        // before s \ x if it feeds it, else just after; positions are doubled to
        // make room.
        const Index X = lv.count;
        auto hpos = [&](Index g) {
            return g == X ? 2 * lv.pos[s] + (x_to_rest ? -1 : 1) : 2 * lv.pos[g];
        };
        const Index e1 = hpos(X) < hpos(t) ? X : t;
        const Index e2 = e1 == X ? t : X;
        const Index limit = hpos(e2);
        seen_.reset(static_cast<size_t>(lv.count) + 1);
        stack_.clear();
        auto expand = [&](Index g, bool start) -> bool {
            const std::vector<Index>& mem = g == X ? fine.members[x] : lv.members[g];
            for (const Index c : mem) {
                if (g == s && in_x(c)) continue;
                for (const Index* d = pb_.succ.begin(c); d != pb_.succ.end(c); ++d) {
                    const Index q = in_x(*d) ? X : lv.group_of[*d];
                    if (q == g) continue;
                    if (q == e2) {
                        if (start) continue;
                        return false;
                    }
                    if (hpos(q) < limit && seen_.set(q)) stack_.push_back(q);
                }
            }
            return true;
        };
        expand(e1, true);
        while (!stack_.empty()) {
            const Index g = stack_.back();
            stack_.pop_back();
            if (!expand(g, false)) return false;
        }

        // The slots between s and t in H order, then: what stays before e1, the
        // range nodes e1 does not reach, t (now holding x), those it reaches, the rest.
        const Index lo = std::min(lv.pos[s], lv.pos[t]), hi = std::max(lv.pos[s], lv.pos[t]);
        std::vector<Index> h;
        for (Index slot = lo; slot <= hi; ++slot) {
            const Index g = lv.order[slot];
            if (g != s) {
                h.push_back(g);
            } else if (x_to_rest) {
                h.push_back(X);
                h.push_back(s);
            } else {
                h.push_back(s);
                h.push_back(X);
            }
        }
        const size_t i1 = std::find(h.begin(), h.end(), e1) - h.begin();
        const size_t i2 = std::find(h.begin(), h.end(), e2) - h.begin();
        plan.lo = lo;
        plan.seq.assign(h.begin(), h.begin() + i1);
        for (size_t i = i1 + 1; i < i2; ++i) {
            if (!seen_.test(h[i])) plan.seq.push_back(h[i]);
        }
        plan.seq.push_back(t);
        for (size_t i = i1 + 1; i < i2; ++i) {
            if (seen_.test(h[i])) plan.seq.push_back(h[i]);
        }
        plan.seq.insert(plan.seq.end(), h.begin() + i2 + 1, h.end());
        return true;
    }

    void apply(Index step, Index x, const Plan& plan) {
        Level& lv = levels_[plan.level];
        const Level& fine = levels_[step];
        for (size_t i = 0; i < plan.seq.size(); ++i) {
            lv.order[plan.lo + i] = plan.seq[i];
            lv.pos[plan.seq[i]] = plan.lo + static_cast<Index>(i);
        }
        std::vector<Index>& sm = lv.members[plan.s];
        sm.erase(std::remove_if(sm.begin(), sm.end(),
                                [&](Index c) { return fine.group_of[c] == x; }),
                 sm.end());
        std::vector<Index>& tm = lv.members[plan.t];
        std::vector<Index> merged;
        merged.reserve(tm.size() + fine.members[x].size());
        std::merge(tm.begin(), tm.end(), fine.members[x].begin(), fine.members[x].end(),
                   std::back_inserter(merged));
        tm.swap(merged);
        for (const Index c : fine.members[x]) lv.group_of[c] = plan.t;
    }
};

// -------------------------------------------------- compaction and numbering

// Groups of `group_of` (ids below `count`, not all used) in topological order,
// the ready group with the smallest member first.
std::vector<Index> canonical_order(const Problem& pb, const std::vector<Index>& group_of,
                                   Index count) {
    std::vector<Index> first(count, -1), indeg(count, 0);
    for (Index c = pb.n - 1; c >= 0; --c) first[group_of[c]] = c;
    const Pairs qe = quotient_edges(pb, group_of);
    for (const auto& [a, b] : qe) ++indeg[b];
    const Csr succ = build_csr(count, qe);
    using Key = std::pair<Index, Index>;  // (first member, group)
    std::priority_queue<Key, std::vector<Key>, std::greater<Key>> ready;
    for (Index g = 0; g < count; ++g) {
        if (first[g] >= 0 && indeg[g] == 0) ready.emplace(first[g], g);
    }
    std::vector<Index> order;
    while (!ready.empty()) {
        const Index g = ready.top().second;
        ready.pop();
        order.push_back(g);
        for (const Index* s = succ.begin(g); s != succ.end(g); ++s) {
            if (--indeg[*s] == 0) ready.emplace(first[*s], *s);
        }
    }
    return order;
}

// Merges neighbours in a topological order of the groups until k remain (paper
// III-B): the group with the smallest time joins its cheaper neighbour, or the
// other if memory forbids. A group that can join neither is set aside until one
// of its neighbours changes, which is when the reference's rescan could first
// pick it again. Returns the new group of each component (old ids).
std::vector<Index> compact(const Problem& pb, const Level& lv) {
    const Index G = lv.count;
    std::vector<double> time(G, 0.0), mem(G, 0.0);
    std::vector<Index> first(G, -1);
    for (Index c = 0; c < pb.n; ++c) {
        const Index g = lv.group_of[c];
        time[g] += (*pb.time)[c];
        mem[g] += (*pb.memory)[c];
        if (first[g] < 0) first[g] = c;
    }
    const std::vector<Index> order = canonical_order(pb, lv.group_of, G);
    if (static_cast<Index>(order.size()) != G) {
        throw std::logic_error("form_blocks: the groups have a cycle between them (a bug)");
    }
    std::vector<Index> prev(G, -1), next(G, -1), root(G);
    std::iota(root.begin(), root.end(), 0);
    for (Index i = 0; i + 1 < G; ++i) {
        next[order[i]] = order[i + 1];
        prev[order[i + 1]] = order[i];
    }
    using Key = std::tuple<double, Index, Index>;  // (time, first member, group)
    auto key = [&](Index g) { return Key{time[g], first[g], g}; };
    std::set<Key> active;
    for (Index g = 0; g < G; ++g) active.insert(key(g));
    Index count = G;
    while (count > pb.k && !active.empty()) {
        const Index v = std::get<2>(*active.begin());
        active.erase(active.begin());
        const Index l = prev[v], r = next[v];
        std::vector<Index> options;
        if (l >= 0 && r >= 0) {
            options = time[r] < time[l] ? std::vector<Index>{r, l} : std::vector<Index>{l, r};
        } else if (l >= 0 || r >= 0) {
            options = {l >= 0 ? l : r};
        }
        for (const Index w : options) {
            if (!(mem[v] + mem[w] <= pb.mem_limit)) continue;
            active.erase(key(w));
            const Index a = w == l ? w : v, b = w == l ? v : w;  // a is on the left
            const double t_sum = time[v] + time[w], m_sum = mem[v] + mem[w];
            time[a] = t_sum;
            mem[a] = m_sum;
            first[a] = std::min(first[a], first[b]);
            next[a] = next[b];
            if (next[b] >= 0) prev[next[b]] = a;
            root[b] = a;
            --count;
            active.insert(key(a));
            if (prev[a] >= 0) active.insert(key(prev[a]));
            if (next[a] >= 0) active.insert(key(next[a]));
            break;
        }
    }
    auto find = [&](Index g) {
        while (root[g] != g) g = root[g] = root[root[g]];
        return g;
    };
    std::vector<Index> out(pb.n);
    for (Index c = 0; c < pb.n; ++c) out[c] = find(lv.group_of[c]);
    return out;
}

}  // namespace

std::vector<int64_t> form_blocks(int64_t n, const std::vector<CoarsenValue>& values,
                                 const std::vector<double>& time,
                                 const std::vector<double>& memory, double mem_limit,
                                 int64_t k, bool uncoarsen) {
    const Problem pb = make_problem(n, values, time, memory, mem_limit, k);
    if (n == 0) return {};
    std::vector<Level> levels = coarsen(pb);
    if (uncoarsen) Refiner(pb, levels).run();
    const std::vector<Index> group_of = compact(pb, levels.back());
    const std::vector<Index> order = canonical_order(pb, group_of, levels.back().count);
    std::vector<Index> number(levels.back().count, -1);
    for (size_t b = 0; b < order.size(); ++b) number[order[b]] = static_cast<Index>(b);
    std::vector<int64_t> block_of(n);
    for (Index c = 0; c < n; ++c) block_of[c] = number[group_of[c]];
    return block_of;
}

void bind_coarsen(py::module_& m) {
    m.def("form_blocks", &form_blocks, py::arg("n"), py::arg("values"), py::arg("time"),
          py::arg("memory"), py::arg("mem_limit"), py::arg("k"), py::arg("uncoarsen") = true,
          py::call_guard<py::gil_scoped_release>(),
          "Blocks of atomic components (paper III-B): block_of per component, blocks "
          "numbered in topological order. See rannc.coarsen.blocks.form_blocks.");
}

}  // namespace rannc
