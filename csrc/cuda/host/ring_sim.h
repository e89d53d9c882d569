// A host simulation of the CUDA-IPC ring: every rank's plan (ring_plan.h) walked with the
// same ordering rules the GPU executor follows (a step reads the predecessor's slot only
// once that step is posted; a slot is rewritten only once the successor has read what
// it held), in an interleaving picked by `seed`. It checks what the GPU cannot show in CI:
// that the schedule finishes, never reads an overwritten slot, and sums correctly.
#pragma once

#include <cstdint>
#include <vector>

#include "core/algorithms/ring_plan.h"

namespace pycomm {

struct RingSimResult {
  std::vector<std::vector<double>> outputs;  // per rank
  size_t steps = 0;                          // per rank
  size_t max_waits = 0;                      // most consecutive blocked tries of one rank
};

// inputs[r] as described by plan_ring's `count`; throws CommError naming the rank and
// step on a deadlock or on a slot read after it was overwritten.
RingSimResult simulate_ring(RingKind kind, const std::vector<std::vector<double>>& inputs,
                            size_t count, int root, size_t chunk_elems, int slots, uint64_t seed);

}  // namespace pycomm
