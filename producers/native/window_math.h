// rankscope: the numeric kernels of a window's conversion (producers/trace_events.py), in C++.
//
// Each function here gives exactly what its numpy twin in producers/trace_events.py gives (same
// ties, same rounding); tests/producers/test_native_extract.py checks that on random and real
// windows. They run on plain int64 arrays with no Python or torch types, so the bindings in
// kineto_columns.cpp call them with the GIL released.
#pragma once

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace rankscope {

using i64 = int64_t;
using Vec = std::vector<i64>;

inline i64 floor_div(i64 a, i64 b) {
  i64 q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

inline i64 floor_mod(i64 a, i64 b) { return a - floor_div(a, b) * b; }

// _call_paths: the path id of every python frame and the interned table (parent path, name), level
// by level, keys sorted within a level as np.unique sorts them.
struct CallPaths {
  Vec path, table_parent, table_name;
};

inline CallPaths call_paths(const i64* ids, const i64* parents, const i64* names, size_t n) {
  CallPaths out;
  out.path.assign(n, -1);
  if (n == 0) return out;
  // by_id: rows in (id, row) order; a frame's parent row is the lowest row with its parent's id.
  std::vector<size_t> by_id(n);
  std::iota(by_id.begin(), by_id.end(), 0);
  const bool sorted = std::is_sorted(ids, ids + n);    // the profiler numbers frames in call order
  if (!sorted) std::stable_sort(by_id.begin(), by_id.end(), [&](size_t a, size_t b) { return ids[a] < ids[b]; });
  Vec sid(n);
  for (size_t k = 0; k < n; ++k) sid[k] = ids[by_id[k]];
  Vec parent(n, -1);
  for (size_t i = 0; i < n; ++i) {
    if (parents[i] >= 0 && parents[i] < ids[i]) {
      const auto it = std::lower_bound(sid.begin(), sid.end(), parents[i]);
      if (it != sid.end() && *it == parents[i]) parent[i] = static_cast<i64>(by_id[static_cast<size_t>(it - sid.begin())]);
    }
  }
  Vec depth(n, 0);
  i64 max_depth = 0;
  for (size_t i : by_id) {                 // a parent's id is lower: its depth is known
    if (parent[i] >= 0) depth[i] = depth[static_cast<size_t>(parent[i])] + 1;
    max_depth = std::max(max_depth, depth[i]);
  }
  std::vector<std::vector<size_t>> levels(static_cast<size_t>(max_depth) + 1);
  for (size_t i = 0; i < n; ++i) levels[static_cast<size_t>(depth[i])].push_back(i);
  const i64 width = *std::max_element(names, names + n) + 1;
  Vec keys;
  for (const auto& rows : levels) {
    keys.clear();
    for (size_t r : rows) {
      const i64 pp = parent[r] >= 0 ? out.path[static_cast<size_t>(parent[r])] : -1;
      keys.push_back((pp + 1) * width + names[r]);
    }
    Vec uniq(keys);
    std::sort(uniq.begin(), uniq.end());
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
    const i64 base = static_cast<i64>(out.table_parent.size());
    for (size_t k = 0; k < rows.size(); ++k) {
      out.path[rows[k]] = base + (std::lower_bound(uniq.begin(), uniq.end(), keys[k]) - uniq.begin());
    }
    for (i64 k : uniq) {
      out.table_parent.push_back(floor_div(k, width) - 1);
      out.table_name.push_back(floor_mod(k, width));
    }
  }
  return out;
}

// _cpu_self_time: self time of intervals on one thread, given sorted by (start, -end, priority).
// Depth of interval i = i - (intervals ending at or before its start); those all come before i and
// starts ascend, so a min-heap of the ends seen so far pops them: the depth is the heap's size.
inline Vec cpu_self_time(const Vec& s, const Vec& e) {
  const size_t n = s.size();
  std::vector<i64> open;                   // min-heap of ends
  Vec last_at(n + 1, -1), children(n, 0);
  for (size_t i = 0; i < n; ++i) {
    while (!open.empty() && open.front() <= s[i]) {
      std::pop_heap(open.begin(), open.end(), std::greater<i64>());
      open.pop_back();
    }
    const i64 d = static_cast<i64>(open.size());
    if (d > 0) {
      const i64 p = last_at[static_cast<size_t>(d - 1)];
      if (p >= 0) children[static_cast<size_t>(p)] += std::max<i64>(std::min(e[i], e[static_cast<size_t>(p)]) - s[i], 0);
    }
    last_at[static_cast<size_t>(d)] = static_cast<i64>(i);
    open.push_back(e[i]);
    std::push_heap(open.begin(), open.end(), std::greater<i64>());
  }
  Vec out(n);
  for (size_t i = 0; i < n; ++i) out[i] = std::max<i64>(e[i] - s[i] - children[i], 0);
  return out;
}

// Stable order of the 2m points (starts, then ends) by time, as np.argsort(kind="stable").
inline std::vector<size_t> point_order(const Vec& t) {
  const size_t h = t.size() / 2;
  if (std::is_sorted(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(h)) &&
      std::is_sorted(t.begin() + static_cast<std::ptrdiff_t>(h), t.end())) {   // starts and ends each sorted: merge
    std::vector<size_t> o;
    o.reserve(t.size());
    size_t a = 0, b = h;
    while (a < h || b < t.size()) {
      if (b == t.size() || (a < h && t[a] <= t[b])) o.push_back(a++);
      else o.push_back(b++);
    }
    return o;
  }
  std::vector<std::pair<i64, size_t>> p(t.size());
  for (size_t k = 0; k < t.size(); ++k) p[k] = {t[k], k};
  std::sort(p.begin(), p.end());           // (time, position): the stable order
  std::vector<size_t> o(t.size());
  for (size_t k = 0; k < t.size(); ++k) o[k] = p[k].second;
  return o;
}

// _uncovered_time: per interval, the time not covered by the union of the cover intervals.
inline Vec uncovered_time(const Vec& s, const Vec& e, const Vec& cs, const Vec& ce) {
  const size_t n = s.size(), m = cs.size();
  Vec out(n);
  if (m == 0) {
    for (size_t i = 0; i < n; ++i) out[i] = e[i] - s[i];
    return out;
  }
  bool proper = true;
  for (size_t k = 0; k < m && proper; ++k) proper = ce[k] >= cs[k];
  if (proper) {                            // the union as disjoint intervals, with busy time before each
    std::vector<size_t> o(m);
    std::iota(o.begin(), o.end(), 0);
    bool by_start = true;
    for (size_t k = 1; k < m && by_start; ++k) by_start = cs[k - 1] <= cs[k];
    if (!by_start) std::sort(o.begin(), o.end(), [&](size_t a, size_t b) { return cs[a] < cs[b]; });
    Vec ua, ub, before;
    i64 busy = 0;
    for (size_t k : o) {
      if (!ua.empty() && cs[k] <= ub.back()) {
        if (ce[k] > ub.back()) { busy += ce[k] - ub.back(); ub.back() = ce[k]; }
      } else {
        before.push_back(busy);
        ua.push_back(cs[k]);
        ub.push_back(ce[k]);
        busy += ce[k] - cs[k];
      }
    }
    auto busy_until = [&](i64 x) -> i64 {  // busy time at or before x
      const i64 k = (std::upper_bound(ua.begin(), ua.end(), x) - ua.begin()) - 1;
      if (k < 0) return 0;
      const size_t kk = static_cast<size_t>(k);
      return before[kk] + std::min(x, ub[kk]) - ua[kk];
    };
    for (size_t i = 0; i < n; ++i) out[i] = std::max<i64>((e[i] - s[i]) - (busy_until(e[i]) - busy_until(s[i])), 0);
    return out;
  }
  Vec t(2 * m);
  std::copy(cs.begin(), cs.end(), t.begin());
  std::copy(ce.begin(), ce.end(), t.begin() + static_cast<std::ptrdiff_t>(m));
  const auto o = point_order(t);
  Vec ts(2 * m), count(2 * m), busy_cum(2 * m, 0);
  i64 c = 0;
  for (size_t k = 0; k < 2 * m; ++k) {
    ts[k] = t[o[k]];
    c += o[k] < m ? 1 : -1;
    count[k] = c;
  }
  for (size_t k = 0; k + 1 < 2 * m; ++k) busy_cum[k + 1] = busy_cum[k] + (count[k] > 0 ? ts[k + 1] - ts[k] : 0);
  auto busy_until = [&](i64 x) -> i64 {
    const i64 k = (std::upper_bound(ts.begin(), ts.end(), x) - ts.begin()) - 1;
    if (k < 0) return 0;
    const size_t kk = static_cast<size_t>(k);
    const i64 tail = (kk < 2 * m - 1 && count[kk] > 0) ? x - ts[kk] : 0;
    return busy_cum[kk] + tail;
  };
  for (size_t i = 0; i < n; ++i) out[i] = std::max<i64>((e[i] - s[i]) - (busy_until(e[i]) - busy_until(s[i])), 0);
  return out;
}

// _sole_time: per interval, the time during which it is the only one running.
inline Vec sole_time(const Vec& s, const Vec& e) {
  const size_t n = s.size();
  Vec t(2 * n);
  std::copy(s.begin(), s.end(), t.begin());
  std::copy(e.begin(), e.end(), t.begin() + static_cast<std::ptrdiff_t>(n));
  const auto o = point_order(t);
  Vec out(n, 0);
  i64 count = 0, idsum = 0;
  for (size_t k = 0; k + 1 < 2 * n; ++k) {
    const bool is_start = o[k] < n;
    const i64 id = static_cast<i64>(is_start ? o[k] : o[k] - n);
    count += is_start ? 1 : -1;
    idsum += is_start ? id : -id;
    const i64 seg = t[o[k + 1]] - t[o[k]];
    if (count == 1 && seg > 0) {
      if (idsum < 0 || idsum >= static_cast<i64>(n)) throw std::invalid_argument("sole_time: malformed intervals");
      out[static_cast<size_t>(idsum)] += seg;
    }
  }
  return out;
}

struct Codes {
  i64 python, collective, cpu_op, annotation;
  std::vector<i64> gpu_work;
};

// exclusive_times: the "not overlapped" ns of every event of a columnar window.
inline Vec exclusive_times(const i64* cat, const i64* start, const i64* dur, const i64* dev, const i64* tid,
                           size_t n, const Codes& codes) {
  Vec out(n, 0), end(n);
  for (size_t i = 0; i < n; ++i) end[i] = start[i] + dur[i];
  auto prio = [&](size_t i) -> int {
    return cat[i] == codes.python ? 0 : cat[i] == codes.collective ? 1 : cat[i] == codes.cpu_op ? 2 : 3;
  };
  auto is_work = [&](size_t i) {
    return std::find(codes.gpu_work.begin(), codes.gpu_work.end(), cat[i]) != codes.gpu_work.end();
  };
  // Rows per host thread (nesting forest), host annotations per thread, device rows per device.
  std::unordered_map<i64, std::vector<size_t>> nest, ann, work, other;
  std::vector<i64> devices;
  for (size_t i = 0; i < n; ++i) {
    if (dev[i] < 0) {
      if (cat[i] == codes.annotation) ann[tid[i]].push_back(i);
      else if (dur[i] > 0) nest[tid[i]].push_back(i);
    } else {
      if (!work.count(dev[i]) && !other.count(dev[i])) devices.push_back(dev[i]);
      (is_work(i) ? work : other)[dev[i]].push_back(i);
    }
  }
  auto gather = [&](const std::vector<size_t>& rows, const Vec& src) {
    Vec v(rows.size());
    for (size_t k = 0; k < rows.size(); ++k) v[k] = src[rows[k]];
    return v;
  };
  Vec st(start, start + n);
  for (auto& kv : nest) {
    std::vector<size_t> idx = kv.second;
    auto before = [&](size_t a, size_t b) {    // (start, -end, priority); row order breaks ties
      if (start[a] != start[b]) return start[a] < start[b];
      if (end[a] != end[b]) return end[a] > end[b];
      return prio(a) < prio(b);
    };
    bool by_interval = true;                    // the window's columns come sorted by (start, -dur)
    for (size_t k = 1; k < idx.size() && by_interval; ++k) {
      const size_t a = idx[k - 1], b = idx[k];
      by_interval = start[a] < start[b] || (start[a] == start[b] && end[a] >= end[b]);
    }
    if (by_interval) {                          // then only runs of equal intervals need the tie break
      for (size_t a = 0; a < idx.size();) {
        size_t b = a + 1;
        while (b < idx.size() && start[idx[b]] == start[idx[a]] && end[idx[b]] == end[idx[a]]) ++b;
        if (b - a > 1) std::stable_sort(idx.begin() + static_cast<std::ptrdiff_t>(a), idx.begin() + static_cast<std::ptrdiff_t>(b), before);
        a = b;
      }
    } else {
      std::stable_sort(idx.begin(), idx.end(), before);
    }
    const Vec self = cpu_self_time(gather(idx, st), gather(idx, end));
    for (size_t k = 0; k < idx.size(); ++k) out[idx[k]] = self[k];
  }
  static const std::vector<size_t> none;
  for (auto& kv : ann) {
    auto it = nest.find(kv.first);
    const auto& cover = it == nest.end() ? none : it->second;
    const Vec u = uncovered_time(gather(kv.second, st), gather(kv.second, end), gather(cover, st), gather(cover, end));
    for (size_t k = 0; k < kv.second.size(); ++k) out[kv.second[k]] = u[k];
  }
  for (i64 d : devices) {
    auto wi = work.find(d);
    const auto& w = wi == work.end() ? none : wi->second;
    if (!w.empty()) {
      const Vec sole = sole_time(gather(w, st), gather(w, end));
      for (size_t k = 0; k < w.size(); ++k) out[w[k]] = sole[k];
    }
    auto ai = other.find(d);
    if (ai != other.end() && !ai->second.empty()) {
      const auto& a = ai->second;
      const Vec u = uncovered_time(gather(a, st), gather(a, end), gather(w, st), gather(w, end));
      for (size_t k = 0; k < a.size(); ++k) out[a[k]] = u[k];
    }
  }
  return out;
}

// summarize's grouping: per distinct key (sorted), count, total, median, p95 (linear, numpy's
// default), max and the sum of ``excl``.
struct Groups {
  Vec key, count, total, median, p95, max, excl;
};

inline Groups group_stats(const i64* key, const i64* dur, const i64* excl, size_t n) {
  std::unordered_map<i64, size_t> slot;          // key -> its group, in order of first appearance
  slot.reserve(n);
  std::vector<i64> keys, xsum;
  std::vector<size_t> group(n), count;
  for (size_t i = 0; i < n; ++i) {
    auto it = slot.emplace(key[i], keys.size()).first;
    if (it->second == keys.size()) {
      keys.push_back(key[i]);
      xsum.push_back(0);
      count.push_back(0);
    }
    group[i] = it->second;
    ++count[it->second];
    xsum[it->second] += excl[i];
  }
  std::vector<size_t> offset(keys.size() + 1, 0);   // the groups' durations, one after the other
  for (size_t u = 0; u < keys.size(); ++u) offset[u + 1] = offset[u] + count[u];
  Vec durs(n);
  std::vector<size_t> fill(offset.begin(), offset.end() - 1);
  for (size_t i = 0; i < n; ++i) durs[fill[group[i]]++] = dur[i];
  std::vector<size_t> order(keys.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return keys[a] < keys[b]; });
  Groups g;
  for (size_t u : order) {
    const auto first = durs.begin() + static_cast<std::ptrdiff_t>(offset[u]);
    const auto last = durs.begin() + static_cast<std::ptrdiff_t>(offset[u + 1]);
    std::sort(first, last);
    i64 total = 0;
    for (auto it = first; it != last; ++it) total += *it;
    const i64 c = static_cast<i64>(count[u]);
    auto d = [&](i64 k) { return *(first + k); };
    const double pos = 0.95 * static_cast<double>(c - 1);
    const i64 lo = static_cast<i64>(std::floor(pos)), hi = static_cast<i64>(std::ceil(pos));
    const i64 vlo = d(lo), vhi = d(hi);
    g.key.push_back(keys[u]);
    g.count.push_back(c);
    g.total.push_back(total);
    g.median.push_back(floor_div(d((c - 1) / 2) + d(c / 2), 2));
    g.p95.push_back(static_cast<i64>(std::nearbyint(static_cast<double>(vlo) +
                                                    static_cast<double>(vhi - vlo) * (pos - static_cast<double>(lo)))));
    g.max.push_back(d(c - 1));
    g.excl.push_back(xsum[u]);
  }
  return g;
}

}  // namespace rankscope
