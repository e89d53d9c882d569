#include "cuda/host/ring_walk.h"

namespace pycomm {
namespace {

OpKind op_kind(RingKind kind) {
  switch (kind) {
    case RingKind::ALL_REDUCE:
      return OpKind::ALL_REDUCE;
    case RingKind::REDUCE_SCATTER:
      return OpKind::REDUCE_SCATTER;
    case RingKind::ALL_GATHER:
      return OpKind::ALL_GATHER;
    case RingKind::BROADCAST:
      return OpKind::BROADCAST;
    case RingKind::REDUCE:
      return OpKind::REDUCE;
  }
  return OpKind::ALL_REDUCE;
}

}  // namespace

OpCall begin_ring_call(RingSync& sync, RingKind kind, DType t, size_t count, RedOp op, int root) {
  return sync.begin(op_kind(kind), t, count, op, ring_has_root(kind) ? root : -1);
}

// A step reads the predecessor's slot only once that step is posted (and tagged as this
// call's), rewrites its own slot only once the successor has read what it held, and is
// posted only after its events are recorded, so a peer's wait on them sees this record.
void walk_ring(RingSync& sync, const OpCall& call, const std::vector<RingStep>& plan, StepIo& io) {
  const uint64_t base = sync.steps();
  const int slots = sync.slots();
  for (size_t i = 0; i < plan.size(); ++i) {
    const RingStep& s = plan[i];
    const uint64_t id = base + i;
    const int slot = static_cast<int>(id % slots);
    int prev_slot = -1;
    uint64_t prev_id = 0;
    if (s.reads_prev) {
      prev_id = base + static_cast<uint64_t>(s.prev_step);
      sync.wait_posted(call, prev_id);
      prev_slot = static_cast<int>(prev_id % slots);
      io.after_prev_wrote(prev_slot);
    }
    if (s.writes_window) {
      const int64_t held = sync.held(slot);
      if (held >= 0) {
        sync.wait_read(call, static_cast<uint64_t>(held));
        io.after_next_read(slot);
      }
    }
    io.run(s, slot, prev_slot);
    if (s.writes_window) {
      io.wrote(slot);
      sync.wrote(call, id);
    }
    if (s.reads_prev) {
      io.read(prev_slot);
      sync.read(prev_id);
    }
    sync.post(id);
  }
  sync.advance(plan.size());
}

}  // namespace pycomm
