// The ring schedule, one encoding for every path: the CPU ring and chains walk it over
// shared-memory channels (ring_walk_cpu.cc: each step one of Prims' primitives), the
// CUDA-IPC ring over its peers' windows (cuda/host/ring_walk.h), and the host simulator
// (cuda/host/ring_sim.cc) checks the GPU's walk of it in CI without a GPU.
//
// Each rank owns a window (CPU: the channel to its successor; CUDA: `slots` chunks its
// successor reads directly, over NVLink or within one GPU). A step reads the local input
// and/or the predecessor's window slot, reduces or copies, and writes this rank's window
// slot and/or the output. Every rank's plan for one call has the same number of steps, so
// a step's position numbers it identically on all ranks (slot = step % slots).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pycomm {

// REDUCE: a chain along the ring that ends at the root (the CPU path's reduce).
enum class RingKind { ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, REDUCE };

struct RingStep {
  bool reads_local = false;  // input[in_offset, +count)
  size_t in_offset = 0;
  bool reads_prev = false;  // the predecessor's window as written at its step `prev_step`
  int64_t prev_step = -1;
  bool writes_window = false;  // this rank's window slot of this step
  bool writes_out = false;     // output[out_offset, +count)
  size_t out_offset = 0;
  size_t count = 0;       // elements (0: the step only keeps the numbering)
  size_t msg_offset = 0;  // where the chunk sits in the op's message (the receiver checks)
  bool final = false;     // the last reduction of an element: AVG's scale goes here
};

// `count`: all_reduce, broadcast and reduce: elements of the tensor; reduce_scatter:
// elements of each rank's output (its input holds nranks * count); all_gather: elements
// of each rank's input (its output holds nranks * count). `chunk_elems` bounds a step's
// count. `root`: broadcast's and reduce's.
std::vector<RingStep> plan_ring(RingKind kind, size_t count, int rank, int nranks, int root,
                                size_t chunk_elems);

const char* ring_kind_name(RingKind kind);

// Whether the kind has a root (broadcast's source, reduce's destination).
inline bool ring_has_root(RingKind kind) {
  return kind == RingKind::BROADCAST || kind == RingKind::REDUCE;
}

// Elements of the op's message: what a step's msg_offset indexes (nranks * count for
// reduce_scatter and all_gather).
size_t ring_message_elems(RingKind kind, size_t count, int nranks);

// How a chunk size is chosen for a message (bytes per window slot): the message split
// so every rank's part takes at least `min_rounds` rounds to pipeline, within
// [min_chunk, max_chunk] bytes (max_chunk wins when they cross), a multiple of 16 (the
// kernels' vector width).
size_t ring_chunk_bytes(size_t message_bytes, int nranks, size_t min_chunk, size_t max_chunk,
                        int min_rounds);

}  // namespace pycomm
