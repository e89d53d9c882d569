// The CPU path's walk of a ring plan (ring_plan.h, the schedule the CUDA ring walks too):
// each step is one of Prims' primitives over the channel from the predecessor and the
// one to the successor. The rings (all_reduce as reduce-scatter then all-gather, and each
// phase alone) and the chains along the ring (broadcast from the root, reduce to it) are
// this walk of their plans.
#include <cstring>

#include "core/algorithms/algorithms.h"
#include "core/algorithms/ring_plan.h"
#include "core/algorithms/ring_prims.h"

namespace pycomm {
namespace {

void run_step(Prims& prims, const RingStep& s, const char* in, char* out, size_t es) {
  const Piece piece{s.msg_offset, s.count};
  const char* mine = s.reads_local ? in + s.in_offset * es : nullptr;
  char* dst = s.writes_out ? out + s.out_offset * es : nullptr;
  if (!s.reads_prev) {  // the start of a chain: this rank's own data
    if (s.writes_window) return prims.copy_send(mine, dst, piece);
    if (dst != mine) std::memmove(dst, mine, s.count * es);  // a ring of one
    return;
  }
  if (mine != nullptr) {  // this rank's data added to what came
    if (!s.writes_window) return prims.recv_reduce_copy(mine, dst, piece);
    if (dst != nullptr) return prims.recv_reduce_copy_send(mine, dst, piece);
    return prims.recv_reduce_send(mine, piece);
  }
  if (s.writes_window) return prims.recv_copy_send(dst, piece);
  prims.recv_copy(dst, piece);
}

void walk_ring_cpu(Transport& t, const OpCall& op, const Args& a, RingKind kind) {
  const int n = t.world(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  Prims prims(t, op, a.dtype, (r - 1 + n) % n, (r + 1) % n, ring_message_elems(kind, a.count, n),
              a.op, a.scale);
  const auto* in = static_cast<const char*>(a.in);
  auto* out = static_cast<char*>(a.out);
  for (const RingStep& s : plan_ring(kind, a.count, r, n, a.root, t.chunk_bytes() / es))
    run_step(prims, s, in, out, es);
}

}  // namespace

void all_reduce_ring(Transport& t, const OpCall& op, const Args& a) {
  walk_ring_cpu(t, op, a, RingKind::ALL_REDUCE);
}
void reduce_scatter_ring(Transport& t, const OpCall& op, const Args& a) {
  walk_ring_cpu(t, op, a, RingKind::REDUCE_SCATTER);
}
void all_gather_ring(Transport& t, const OpCall& op, const Args& a) {
  walk_ring_cpu(t, op, a, RingKind::ALL_GATHER);
}
void broadcast_chain(Transport& t, const OpCall& op, const Args& a) {
  walk_ring_cpu(t, op, a, RingKind::BROADCAST);
}
void reduce_chain(Transport& t, const OpCall& op, const Args& a) {
  walk_ring_cpu(t, op, a, RingKind::REDUCE);
}

}  // namespace pycomm
