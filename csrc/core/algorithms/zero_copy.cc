#include "core/algorithms/zero_copy.h"

#include <algorithm>
#include <cstring>

#include "core/algorithms/parts.h"
#include "core/communicator/faults.h"
#include "core/kernels/reduce.h"

namespace pycomm {
namespace {

struct Offer {
  uint32_t in_arena;
  uint32_t pad;
  uint64_t pid_ns;  // see pid_namespace_id()
  ArenaLocation where;
};

// Every rank's buffer at `offset`, in rank order: every rank combines sources in the
// same order, as the direct and ring paths do. The kernels allow the destination to be
// one of them (all_reduce in place, or an output that aliases our own input block).
std::vector<const void*> at_offset(const std::vector<char*>& bufs, size_t offset) {
  std::vector<const void*> srcs;
  for (char* b : bufs) srcs.push_back(b + offset);
  return srcs;
}

}  // namespace

ZeroCopyPlan negotiate_zero_copy(Transport& t, PeerMemory& peers, const OpCall& op,
                                 const void* mine, size_t bytes) {
  auto* offer = static_cast<Offer*>(t.direct_buffer(op));
  ArenaLocation where;
  offer->in_arena = mine != nullptr && Arena::instance().locate(mine, bytes, &where);
  offer->where = posted(where);
  offer->pid_ns = pid_namespace_id();
  t.post_direct(op);
  std::vector<const Offer*> offers(t.world());
  for (int r = 0; r < t.world(); ++r) offers[r] = static_cast<const Offer*>(t.wait_direct(r, op));
  ZeroCopyPlan plan;
  for (const Offer* o : offers) {
    if (!o->in_arena) plan.why_not = "not every rank's buffer is in the arena";
  }
  for (const Offer* o : offers) {
    if (o->pid_ns == 0 || o->pid_ns != offers[0]->pid_ns)
      plan.why_not = "the ranks are in different PID namespaces";
  }
  if (*plan.why_not != '\0') return plan;
  for (int r = 0; r < t.world(); ++r) {
    plan.bufs.push_back(r == t.rank() ? static_cast<char*>(const_cast<void*>(mine))
                                      : peers.resolve(r, offers[r]->where, bytes));
  }
  return plan;
}

// Each rank owns one contiguous part of the tensor (split on cache lines, so no two
// ranks write one line). It reads its part from every rank's buffer once and writes the
// result into every rank's buffer: one pass, nothing read back. Nobody else reads or
// writes that part of any buffer, so no wait is needed until the end; the last one keeps
// us from returning while a peer may still read or write our buffer. (Pulling instead,
// reduce then copy the peers' results, reads each byte twice: about 1.5x the work.)
void all_reduce_zero_copy(Transport& t, const OpCall& op, const Args& a,
                          const std::vector<char*>& bufs) {
  const int n = t.world();
  const size_t es = dtype_size(a.dtype);
  Piece mine = own_part(a.count, n, t.rank(), es);
  if (mine.count > 0) {
    std::vector<const void*> srcs = at_offset(bufs, mine.offset * es);
    std::vector<void*> dsts(n);
    for (int q = 0; q < n; ++q) dsts[q] = bufs[q] + mine.offset * es;
    reduce_copy(a.dtype, a.op, dsts.data(), n, srcs.data(), n, mine.count, a.scale);
  }
  t.post_stage(op, 1);
  t.wait_stage(op, 1);
}

// As all_reduce, with one destination: every rank reduces its part straight into the
// root's buffer, so the root does 1/n of the work rather than all of it. bufs[root] is
// the root's tensor, input and output at once (the caller only offers it then).
void reduce_zero_copy(Transport& t, const OpCall& op, const Args& a,
                      const std::vector<char*>& bufs) {
  const size_t es = dtype_size(a.dtype);
  Piece mine = own_part(a.count, t.world(), t.rank(), es);
  if (mine.count > 0) {
    std::vector<const void*> srcs = at_offset(bufs, mine.offset * es);
    void* dst = bufs[a.root] + mine.offset * es;
    reduce_copy(a.dtype, a.op, &dst, 1, srcs.data(), t.world(), mine.count, a.scale);
  }
  t.post_stage(op, 1);
  t.wait_stage(op, 1);
}

void reduce_scatter_zero_copy(Transport& t, const OpCall& op, const Args& a,
                              const std::vector<char*>& bufs) {
  const int r = t.rank();
  const size_t off = r * a.count * dtype_size(a.dtype);
  auto srcs = at_offset(bufs, off);
  reduce_many(a.dtype, a.op, a.out, srcs.data(), t.world(), a.count, a.scale);
  t.post_stage(op, 1);
  t.wait_stage(op, 1);
}

void all_gather_zero_copy(Transport& t, const OpCall& op, const Args& a,
                          const std::vector<char*>& bufs) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  auto* out = static_cast<char*>(a.out);
  for (int q = 0; q < t.world(); ++q) {
    if (out + q * bytes != bufs[q]) std::memmove(out + q * bytes, bufs[q], bytes);
  }
  t.post_stage(op, 1);
  t.wait_stage(op, 1);
}

// One copy per receiver, all reading the root's buffer at once, instead of the chain's
// copy into a slot and out of it at every hop. The wait keeps the root from returning
// (and changing its tensor) while a receiver still reads it.
void broadcast_zero_copy(Transport& t, const OpCall& op, const Args& a,
                         const std::vector<char*>& bufs) {
  if (t.rank() != a.root) std::memcpy(a.out, bufs[a.root], a.count * dtype_size(a.dtype));
  t.post_stage(op, 1);
  t.wait_stage(op, 1);
}

}  // namespace pycomm
