// Walking one rank's ring plan (ring_plan.h): the host decides when each step may be
// enqueued (ring_sync.h) and the device side (StepIo) enqueues it. The CUDA executor
// (ipc_ring.cu) waits on and records interprocess events and launches the copy-reduce;
// tests walk plans with a StepIo that does nothing, over real processes, without a GPU.
#pragma once

#include <cstddef>
#include <vector>

#include "core/algorithms/ring_plan.h"
#include "cuda/host/ring_sync.h"

namespace pycomm {

// The device work of a step, called in this order for each step, each once the host
// condition it needs holds.
class StepIo {
 public:
  virtual ~StepIo() = default;
  // The predecessor has posted the step it wrote into its `slot`: order what follows
  // after that write (the wait must be enqueued after the writer's record).
  virtual void after_prev_wrote(int slot) = 0;
  // The successor has enqueued its read of this rank's `slot`: order the rewrite after it.
  virtual void after_next_read(int slot) = 0;
  // The step itself: reads the local input and/or the predecessor's `prev_slot` (-1:
  // none), writes this rank's `slot` (when s.writes_window) and/or the output.
  virtual void run(const RingStep& s, int slot, int prev_slot) = 0;
  // Marks the end of the step's write of `slot` / read of the predecessor's `prev_slot`
  // (the events peers wait on), before the step is posted.
  virtual void wrote(int slot) = 0;
  virtual void read(int prev_slot) = 0;
};

// Numbers and publishes a ring op as the call it is (root only for broadcast), for
// sync.begin's agreement checks.
OpCall begin_ring_call(RingSync& sync, RingKind kind, DType t, size_t count, RedOp op, int root);

// Walks `plan` as `call` (from sync.begin) and advances the ring's step count. Throws
// CommError (recorded for the job) on a timeout, a dead peer or a disagreeing one.
void walk_ring(RingSync& sync, const OpCall& call, const std::vector<RingStep>& plan, StepIo& io);

}  // namespace pycomm
