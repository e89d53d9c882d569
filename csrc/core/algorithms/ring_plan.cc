#include "core/algorithms/ring_plan.h"

#include <algorithm>

#include "core/base/errors.h"

namespace pycomm {
namespace {

int wrap(long i, int n) { return static_cast<int>(((i % n) + n) % n); }

// `count` elements in `parts` near-equal parts (the first count % parts one longer).
struct Parts {
  size_t base, rem;
  size_t begin(int p) const { return p * base + std::min<size_t>(p, rem); }
  size_t size(int p) const { return base + (static_cast<size_t>(p) < rem ? 1 : 0); }
};

// The round-th chunk of a run of `len` elements that starts at `start`.
struct Chunk {
  size_t offset, count;
};
Chunk chunk_of(size_t start, size_t len, size_t round, size_t chunk) {
  size_t from = std::min(round * chunk, len);
  return {start + from, std::min(chunk, len - from)};
}

size_t rounds_for(size_t longest, size_t chunk) {
  return std::max<size_t>(1, (longest + chunk - 1) / chunk);
}

// Reduce-scatter then (for all_reduce) all-gather, per round: at step t of the
// reduce-scatter rank r holds the partial sum of part (r - t - 1): its own input's part
// at t = 0, then the predecessor's partial (its step t - 1) plus its own. After
// n - 1 steps the part r is complete; all-gather passes the complete parts on.
void plan_reduce_ring(std::vector<RingStep>& out, bool all_reduce, size_t count, int r, int n,
                      size_t chunk) {
  // all_reduce: parts of the tensor; reduce_scatter: part p is rank p's output.
  Parts parts = all_reduce ? Parts{count / n, count % n} : Parts{count, 0};
  size_t rounds = rounds_for(parts.size(0), chunk);
  size_t round_base = 0;
  const size_t steps_per_round = all_reduce ? 2 * n - 1 : n;
  for (size_t round = 0; round < rounds; ++round, round_base += steps_per_round) {
    for (int t = 0; t < n; ++t) {
      int part = wrap(r - t - 1, n);
      Chunk c = chunk_of(parts.begin(part), parts.size(part), round, chunk);
      RingStep s;
      s.reads_local = true;
      s.in_offset = s.msg_offset = c.offset;
      s.count = c.count;
      if (t > 0) {
        s.reads_prev = true;
        s.prev_step = static_cast<int64_t>(round_base + t - 1);
      }
      bool last = t == n - 1;
      s.writes_window = !last || (all_reduce && n > 1);
      if (last) {
        s.final = true;
        s.writes_out = true;
        s.out_offset = all_reduce ? c.offset : c.offset - parts.begin(part);
      }
      out.push_back(s);
    }
    if (!all_reduce) continue;
    for (int t = 1; t < n; ++t) {
      int part = wrap(r - t, n);
      Chunk c = chunk_of(parts.begin(part), parts.size(part), round, chunk);
      RingStep s;
      s.reads_prev = true;
      s.prev_step = static_cast<int64_t>(round_base + n - 1 + t - 1);
      s.writes_window = t < n - 1;
      s.writes_out = true;
      s.out_offset = s.msg_offset = c.offset;
      s.count = c.count;
      out.push_back(s);
    }
  }
}

// At step t rank r passes on rank (r - t)'s block: its own input at t = 0.
void plan_all_gather(std::vector<RingStep>& out, size_t count, int r, int n, size_t chunk) {
  size_t rounds = rounds_for(count, chunk);
  for (size_t round = 0; round < rounds; ++round) {
    size_t round_base = round * n;
    for (int t = 0; t < n; ++t) {
      int block = wrap(r - t, n);
      Chunk c = chunk_of(0, count, round, chunk);
      RingStep s;
      s.count = c.count;
      s.writes_out = true;
      s.out_offset = s.msg_offset = block * count + c.offset;
      if (t == 0) {
        s.reads_local = true;
        s.in_offset = c.offset;
      } else {
        s.reads_prev = true;
        s.prev_step = static_cast<int64_t>(round_base + t - 1);
      }
      s.writes_window = t < n - 1;
      out.push_back(s);
    }
  }
}

// A chain from the root along the ring; one step per round on every rank. The root's
// output is its input (torch broadcasts in place), so it writes only its window.
void plan_broadcast(std::vector<RingStep>& out, size_t count, int r, int n, int root,
                    size_t chunk) {
  size_t rounds = rounds_for(count, chunk);
  bool is_root = r == root;
  bool next_is_root = wrap(r + 1, n) == root;
  for (size_t round = 0; round < rounds; ++round) {
    Chunk c = chunk_of(0, count, round, chunk);
    RingStep s;
    s.count = c.count;
    s.msg_offset = c.offset;
    if (is_root) {
      s.reads_local = true;
      s.in_offset = c.offset;
    } else {
      s.reads_prev = true;
      s.prev_step = static_cast<int64_t>(round);
      s.writes_out = true;
      s.out_offset = c.offset;
    }
    s.writes_window = !next_is_root && n > 1;
    out.push_back(s);
  }
}

// A chain along the ring that ends at the root: root + 1 starts the partial sum, each
// next rank adds its own, the root adds its own last and keeps the value.
void plan_reduce(std::vector<RingStep>& out, size_t count, int r, int n, int root, size_t chunk) {
  size_t rounds = rounds_for(count, chunk);
  const int pos = wrap(r - root - 1, n);  // 0: root + 1; n - 1: the root
  for (size_t round = 0; round < rounds; ++round) {
    Chunk c = chunk_of(0, count, round, chunk);
    RingStep s;
    s.count = c.count;
    s.msg_offset = s.in_offset = c.offset;
    s.reads_local = true;
    if (pos > 0) {
      s.reads_prev = true;
      s.prev_step = static_cast<int64_t>(round);
    }
    if (pos == n - 1) {
      s.writes_out = s.final = true;
      s.out_offset = c.offset;
    } else {
      s.writes_window = true;
    }
    out.push_back(s);
  }
}

}  // namespace

std::vector<RingStep> plan_ring(RingKind kind, size_t count, int rank, int nranks, int root,
                                size_t chunk_elems) {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    throw InvalidArgument("pycomm: ring plan for rank " + std::to_string(rank) + " of " +
                          std::to_string(nranks));
  }
  if (ring_has_root(kind) && (root < 0 || root >= nranks)) {
    throw InvalidArgument(std::string("pycomm: ") + ring_kind_name(kind) + " root " +
                          std::to_string(root) + " is not a rank of " + std::to_string(nranks));
  }
  size_t chunk = std::max<size_t>(1, chunk_elems);
  std::vector<RingStep> steps;
  switch (kind) {
    case RingKind::ALL_REDUCE:
    case RingKind::REDUCE_SCATTER:
      plan_reduce_ring(steps, kind == RingKind::ALL_REDUCE, count, rank, nranks, chunk);
      break;
    case RingKind::ALL_GATHER:
      plan_all_gather(steps, count, rank, nranks, chunk);
      break;
    case RingKind::BROADCAST:
      plan_broadcast(steps, count, rank, nranks, root, chunk);
      break;
    case RingKind::REDUCE:
      plan_reduce(steps, count, rank, nranks, root, chunk);
      break;
  }
  return steps;
}

size_t ring_message_elems(RingKind kind, size_t count, int nranks) {
  bool per_rank = kind == RingKind::REDUCE_SCATTER || kind == RingKind::ALL_GATHER;
  return per_rank ? count * static_cast<size_t>(nranks) : count;
}

const char* ring_kind_name(RingKind kind) {
  switch (kind) {
    case RingKind::ALL_REDUCE:
      return "all_reduce";
    case RingKind::REDUCE_SCATTER:
      return "reduce_scatter";
    case RingKind::ALL_GATHER:
      return "all_gather";
    case RingKind::BROADCAST:
      return "broadcast";
    case RingKind::REDUCE:
      return "reduce";
  }
  return "?";
}

size_t ring_chunk_bytes(size_t message_bytes, int nranks, size_t min_chunk, size_t max_chunk,
                        int min_rounds) {
  size_t part = message_bytes / std::max(1, nranks);
  size_t want = part / std::max(1, min_rounds);
  size_t chunk = std::clamp(want, std::min(min_chunk, max_chunk), max_chunk);
  return std::max<size_t>(16, chunk / 16 * 16);
}

}  // namespace pycomm
