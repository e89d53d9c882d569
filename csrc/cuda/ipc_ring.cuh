// The CUDA-IPC ring: collectives across the local ranks' GPUs (or several ranks on one
// GPU), torch-free. Each rank owns a window of `slots` chunks in device memory that its
// successor maps through CUDA IPC and reads directly (peer reads over NVLink). The steps
// come from ring_plan.h; each is one copy-reduce kernel on the caller's stream.
//
// Ordering between ranks uses interprocess CUDA events, enqueued in order through
// counters in host shared memory (cuda/host/ring_sync.h): a rank waits on its
// predecessor's "ready" event of a slot only once the predecessor has posted that step
// (so the wait sees that record, not an older one), and rewrites a slot only after its
// successor's "consumed" event for the previous contents. The GPU then runs every rank's
// steps as a pipeline; the host only orders the enqueueing. This needs no concurrent
// kernels across processes, so it also works for several ranks on one GPU without MPS
// (spinning on flags in device memory would not: kernels of different processes are
// time-sliced, not co-resident). The host side (numbering and agreement of calls, the
// abort record, liveness, the waits) is CUDA-free and tested without a GPU.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/algorithms/ring_plan.h"
#include "core/base/config.h"
#include "core/base/types.h"
#include "core/communicator/rendezvous.h"
#include "cuda/host/ipc_handles.h"
#include "cuda/host/ring_sync.h"

namespace pycomm {
namespace cuda {

struct RingOptions {
  size_t slot_bytes = size_t{4} << 20;  // Config::cuda_chunk_bytes
  int slots = 4;                        // Config::cuda_slots
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  LogSettings log;            // PYCOMM_DEBUG=TRACE: one line per op
  WaitPolicy wait{20, 1000};  // PYCOMM_SPIN_US, PYCOMM_YIELD_US
  static RingOptions from_env(std::chrono::milliseconds timeout);
};

class CudaStepIo;

class IpcRing {
 public:
  // Collective: every rank of the group constructs it with its own CUDA device.
  IpcRing(Rendezvous& rdv, int rank, int size, int device, RingOptions opts);
  // Never blocks without bound: waits (up to the timeout, a moment once the job failed or
  // a peer died) for this ring's work on the GPU and for the neighbours to be done with
  // this rank's window and events; what is still in use then is leaked, not freed.
  ~IpcRing();
  IpcRing(const IpcRing&) = delete;
  IpcRing& operator=(const IpcRing&) = delete;

  // `count` as in plan_ring. All enqueue on `stream` and return once enqueued; errors
  // (a peer that does not post in time, dies, or called another op; a CUDA error) throw
  // CommError on this rank and are recorded for the other ranks, which raise them too.
  void all_reduce(void* out, const void* in, size_t count, DType t, RedOp op, cudaStream_t stream);
  void reduce_scatter(void* out, const void* in, size_t count, DType t, RedOp op,
                      cudaStream_t stream);
  void all_gather(void* out, const void* in, size_t count, DType t, cudaStream_t stream);
  void broadcast(void* buf, size_t count, DType t, int root, cudaStream_t stream);

  int device() const { return device_; }
  // The sequence number of the last op (1, 2, ... per ring; 0 before the first).
  uint64_t seq() const { return sync_ ? sync_->seq() : 0; }
  void set_timeout(std::chrono::milliseconds t);
  // Records `why` as the job's failure: every rank's next wait (or op) raises it.
  void abort(const std::string& why);

 private:
  friend class CudaStepIo;
  void run(RingKind kind, size_t count, DType t, RedOp op, int root, void* out, const void* in,
           cudaStream_t stream);
  void exchange(Rendezvous& rdv);
  void check(cudaError_t e, const char* what);
  void mark_in_flight(cudaStream_t stream) noexcept;
  bool own_work_done();
  bool release_when_unused();

  int rank_, size_, prev_, next_, device_;
  RingOptions opts_;
  std::string current_op_;  // for messages: "all_reduce float32[8] SUM (seq 3) on rank 0"
  std::unique_ptr<RingSync> sync_;
  char* window_ = nullptr;
  const char* prev_window_ = nullptr;
  std::vector<cudaEvent_t> ready_, consumed_;            // mine
  std::vector<cudaEvent_t> prev_ready_, next_consumed_;  // opened from the neighbours
  // Per stream the ring ran on: an event recorded after its last op (for teardown).
  std::vector<std::pair<cudaStream_t, cudaEvent_t>> in_flight_;
  bool untracked_ = false;  // an op's end could not be recorded: never "done"
};

}  // namespace cuda
}  // namespace pycomm
