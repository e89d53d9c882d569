// Tunables read from the environment (like NCCL_*), once per communicator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/base/log.h"

namespace pycomm {

enum class Algo { AUTO, RING, DIRECT };

constexpr uint32_t kMaxStripes = 16;         // PYCOMM_STRIPES' upper bound
constexpr size_t kTwoShotAuto = ~size_t{0};  // PYCOMM_TWO_SHOT_BYTES unset
// A two-shot all_reduce takes two steps per piece (reduce_scatter and all_gather one),
// and an op has 2^20 steps (Transport).
constexpr size_t kMaxTwoShotPieces = size_t{1} << 18;

struct Config {
  size_t chunk_bytes = 256 << 10;  // PYCOMM_CHUNK_BYTES: payload of one slot
  // PYCOMM_SLOTS: messages a channel holds in flight, each in its own buffer (2..64). A
  // channel starts with 4 buffers and grows only while its receiver is behind (layout.h).
  uint32_t slots = 64;
  // PYCOMM_DIRECT_BYTES: largest message the direct algorithm takes. Unset, rank 0
  // picks it from the ranks per core when the communicator is created.
  size_t direct_bytes = 64 << 10;
  Algo algo = Algo::AUTO;  // PYCOMM_ALGO=auto|ring|direct
  // PYCOMM_TWO_SHOT_BYTES: largest all_reduce, reduce_scatter (its whole input) or
  // all_gather (its input) of more than two ranks that takes the two-shot (two_shot.cc)
  // instead of the ring; 0 turns it off. Unset, rank 0 picks it
  // from the world size when the communicator is created (group_segment.cc).
  // PYCOMM_TWO_SHOT_PIECE_BYTES: what one round of it stages per rank; a rank's stage
  // area holds two pieces for each of two sequence numbers (layout.h).
  size_t two_shot_bytes = kTwoShotAuto;
  size_t two_shot_piece_bytes = size_t{512} << 10;
  LogSettings log;  // PYCOMM_DEBUG, PYCOMM_DEBUG_SUBSYS (see log.h)
  // A waiter polls with `pause` for spin_us, then polls with sched_yield() (handing the
  // core to a peer that may need it) until yield_us, then sleeps on a futex. Both are
  // time-based: how long one `pause` takes differs 40x between CPU generations.
  uint32_t spin_us = 20;     // PYCOMM_SPIN_US (default 0 when ranks > cores)
  uint32_t yield_us = 1000;  // PYCOMM_YIELD_US
  // PYCOMM_WAIT_SLICE_US: the time slice a thread asks the scheduler for while it sleeps
  // for a peer (wait_slice.h), 0 to leave the scheduler's. 100 us is the least Linux grants.
  uint32_t wait_slice_us = 100;
  bool zero_copy = true;  // PYCOMM_ZERO_COPY=0 turns off in-place reads of arena tensors
  // PYCOMM_STRIPES: communicators a torch group stripes its large CPU all_reduces over,
  // each on its own thread (csrc/torch/backend/stripes.h); 1, the default, is the group's
  // own only. A rank that shares its core with busy threads gets one scheduler share per
  // thread, as gloo's worker threads do. PYCOMM_STRIPE_BYTES: the least all_reduce striped.
  uint32_t stripes = 1;
  size_t stripe_bytes = size_t{4} << 20;
  // The CUDA-IPC ring (csrc/cuda): bytes per window slot (16-byte multiple) and slots.
  size_t cuda_chunk_bytes = size_t{4} << 20;  // PYCOMM_CUDA_CHUNK_BYTES
  uint32_t cuda_slots = 4;                    // PYCOMM_CUDA_SLOTS (>= 2)

  // Reads the PYCOMM_* variables; a malformed value throws InvalidArgument naming it.
  static Config from_env();
};

const char* algo_name(Algo a);

}  // namespace pycomm
