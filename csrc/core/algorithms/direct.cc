// Direct algorithms for small messages: every rank copies its input into its own direct
// area once, then reads what it needs from every rank's area. Two synchronisation points
// fewer than a ring step each, which is what matters below a few tens of KB.
// Reductions read the sources in rank order, so all ranks compute bit-identical results.
#include <cstring>
#include <vector>

#include "core/algorithms/algorithms.h"
#include "core/kernels/reduce.h"

namespace pycomm {
namespace {

// Posts `bytes` of `src` (may be null for 0 bytes) in this rank's area.
void post(Transport& t, const OpCall& op, const void* src, size_t bytes) {
  void* area = t.direct_buffer(op);
  if (bytes) std::memcpy(area, src, bytes);
  t.post_direct(op);
}

// One pointer per rank, on the stack for the usual group sizes: a heap allocation per op
// is a tenth of a 1 KB all_reduce's own time.
class RankAreas {
 public:
  explicit RankAreas(int world) : n_(world) {
    if (world > kOnStack) heap_.resize(static_cast<size_t>(world));
  }
  const char** data() { return n_ > kOnStack ? heap_.data() : on_stack_; }
  const char*& operator[](int r) { return data()[r]; }
  const char** begin() { return data(); }
  const char** end() { return data() + n_; }

 private:
  static constexpr int kOnStack = 16;
  int n_;
  const char* on_stack_[kOnStack];
  std::vector<const char*> heap_;
};

// Every rank's posted area (this rank's own included), in rank order.
RankAreas everyone(Transport& t, const OpCall& op) {
  RankAreas areas(t.world());
  for (int r = 0; r < t.world(); ++r) {
    areas[r] = static_cast<const char*>(t.wait_direct(r, op));
  }
  return areas;
}

}  // namespace

void all_reduce_direct(Transport& t, const OpCall& op, const Args& a) {
  post(t, op, a.in, a.count * dtype_size(a.dtype));
  auto areas = everyone(t, op);
  reduce_many(a.dtype, a.op, a.out, reinterpret_cast<const void* const*>(areas.data()), t.world(),
              a.count, a.scale);
}

void reduce_scatter_direct(Transport& t, const OpCall& op, const Args& a) {
  const size_t es = dtype_size(a.dtype);
  post(t, op, a.in, a.count * t.world() * es);
  auto areas = everyone(t, op);
  for (auto& p : areas) p += t.rank() * a.count * es;  // only our block of each input
  reduce_many(a.dtype, a.op, a.out, reinterpret_cast<const void* const*>(areas.data()), t.world(),
              a.count, a.scale);
}

void all_gather_direct(Transport& t, const OpCall& op, const Args& a) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  post(t, op, a.in, bytes);
  auto areas = everyone(t, op);
  for (int r = 0; r < t.world(); ++r) {
    std::memcpy(static_cast<char*>(a.out) + r * bytes, areas[r], bytes);
  }
}

void broadcast_direct(Transport& t, const OpCall& op, const Args& a) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  if (t.rank() == a.root) {
    post(t, op, a.out, bytes);
  } else {
    std::memcpy(a.out, t.wait_direct(a.root, op), bytes);
  }
}

void reduce_direct(Transport& t, const OpCall& op, const Args& a) {
  post(t, op, a.in, a.count * dtype_size(a.dtype));
  if (t.rank() != a.root) return;
  auto areas = everyone(t, op);
  reduce_many(a.dtype, a.op, a.out, reinterpret_cast<const void* const*>(areas.data()), t.world(),
              a.count, a.scale);
}

void barrier_direct(Transport& t, const OpCall& op) {
  post(t, op, nullptr, 0);
  everyone(t, op);
}

}  // namespace pycomm
