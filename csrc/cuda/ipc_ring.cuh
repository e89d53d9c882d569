// The CUDA-IPC ring: collectives across the local ranks' GPUs (or several ranks on one
// GPU), torch-free. Each rank owns a window of `slots` chunks in device memory that its
// successor maps through CUDA IPC and reads directly (peer reads over NVLink). The steps
// come from ring_plan.h; each is one copy-reduce kernel on the caller's stream.
//
// Ordering between ranks uses interprocess CUDA events, enqueued in order through two
// counters per rank in host shared memory: a rank waits on its predecessor's "ready"
// event of a slot only once the predecessor has posted that step (so the wait sees that
// record, not an older one), and rewrites a slot only after its successor's "consumed"
// event for the previous contents. The GPU then runs every rank's steps as a pipeline;
// the host only orders the enqueueing. This needs no concurrent kernels across processes,
// so it also works for several ranks on one GPU without MPS (spinning on flags in device
// memory would not: kernels of different processes are time-sliced, not co-resident).
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/runtime/config.h"
#include "core/runtime/rendezvous.h"
#include "core/runtime/types.h"
#include "core/transport/shm_segment.h"
#include "cuda/host/ipc_handles.h"
#include "cuda/host/ring_plan.h"

namespace pycomm {
namespace cuda {

struct RingOptions {
  size_t slot_bytes = size_t{4} << 20;  // Config::cuda_chunk_bytes
  int slots = 4;                        // Config::cuda_slots
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  LogLevel log = LogLevel::WARN;  // PYCOMM_DEBUG=INFO: one line per op
  static RingOptions from_env(std::chrono::milliseconds timeout);
};

struct HostCounters;  // in the shared segment, one per rank

class IpcRing {
 public:
  // Collective: every rank of the group constructs it with its own CUDA device.
  IpcRing(Rendezvous& rdv, int rank, int size, int device, RingOptions opts);
  ~IpcRing();
  IpcRing(const IpcRing&) = delete;
  IpcRing& operator=(const IpcRing&) = delete;

  // `count` as in plan_ring. All enqueue on `stream` and return once enqueued; errors
  // (a peer that does not post in time, a CUDA error) throw CommError on this rank and
  // set the abort flag the other ranks check while they wait.
  void all_reduce(void* out, const void* in, size_t count, DType t, RedOp op, cudaStream_t stream);
  void reduce_scatter(void* out, const void* in, size_t count, DType t, RedOp op,
                      cudaStream_t stream);
  void all_gather(void* out, const void* in, size_t count, DType t, cudaStream_t stream);
  void broadcast(void* buf, size_t count, DType t, int root, cudaStream_t stream);

  int device() const { return device_; }
  void set_timeout(std::chrono::milliseconds t) { opts_.timeout = t; }
  // Marks the job failed so every rank's next wait throws (abort()).
  void abort(const std::string& why);

 private:
  void run(RingKind kind, size_t count, DType t, RedOp op, int root, void* out, const void* in,
           cudaStream_t stream);
  template <typename Ready>
  void wait_host(Ready ready, int peer, const char* what, uint64_t step);
  void exchange(Rendezvous& rdv);
  void check(cudaError_t e, const char* what);

  int rank_, size_, prev_, next_, device_;
  RingOptions opts_;
  std::string current_op_;             // for messages
  uint64_t steps_ = 0;                 // steps walked so far (the same on every rank)
  std::vector<int64_t> last_written_;  // per slot: the step last written there
  ShmSegment shm_;
  HostCounters* counters_ = nullptr;
  char* window_ = nullptr;
  const char* prev_window_ = nullptr;
  std::vector<cudaEvent_t> ready_, consumed_;            // mine
  std::vector<cudaEvent_t> prev_ready_, next_consumed_;  // opened from the neighbours
};

}  // namespace cuda
}  // namespace pycomm
