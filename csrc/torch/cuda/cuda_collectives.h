// The CUDA half of ProcessGroupPycomm (built only with PYCOMM_CUDA): collectives on CUDA
// tensors through the CUDA-IPC ring (csrc/cuda/ipc_ring), on the caller's current stream.
// Each returns once the op is enqueued, with a Work like NCCL's: isCompleted() asks the
// GPU, wait() makes the current stream wait for the op (list forms' copies back
// included), and the future is marked complete with CUDA events.
#pragma once

#ifdef PYCOMM_CUDA

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "core/base/types.h"

namespace pycomm {
namespace cuda {
class IpcRing;
}
}  // namespace pycomm

namespace pycomm_torch {

class CudaCollectives {
 public:
  CudaCollectives(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                  std::chrono::milliseconds timeout);
  ~CudaCollectives();

  c10::intrusive_ptr<c10d::Work> all_reduce(at::Tensor& t, const c10d::ReduceOp& op);
  // Flattened into one buffer, reduced, copied back (all on the stream, before the
  // Work's event).
  c10::intrusive_ptr<c10d::Work> all_reduce_coalesced(std::vector<at::Tensor>& tensors,
                                                      const c10d::ReduceOp& op);
  c10::intrusive_ptr<c10d::Work> broadcast(at::Tensor& t, int root);
  c10::intrusive_ptr<c10d::Work> all_gather_base(at::Tensor& out, at::Tensor& in);
  c10::intrusive_ptr<c10d::Work> all_gather(std::vector<at::Tensor>& outs, at::Tensor& in);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                     const c10d::ReduceOp& op);
  c10::intrusive_ptr<c10d::Work> reduce_scatter(at::Tensor& out, std::vector<at::Tensor>& ins,
                                                const c10d::ReduceOp& op);
  // One ring op per pair, in order, on the one stream (as the CPU path does): FSDP2's
  // all-gathers and reduce-scatters of several parameters at once.
  c10::intrusive_ptr<c10d::Work> all_gather_into_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                                  std::vector<at::Tensor>& ins);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                                 std::vector<at::Tensor>& ins,
                                                                 const c10d::ReduceOp& op);
  // Rooted ops through the ring's collectives, moving more bytes than a rooted algorithm
  // would (every rank gets what only the root needs): correct first, for DTensor's
  // distribute_tensor (scatter) and the like, which are not on a training step's path.
  // reduce: an all_reduce of a copy, committed on the root only (the others' tensors
  // come back unchanged); gather: an all_gather, unpacked on the root; scatter: the root's
  // list broadcast, each rank keeping its block.
  c10::intrusive_ptr<c10d::Work> reduce(at::Tensor& t, const c10d::ReduceOp& op, int root);
  c10::intrusive_ptr<c10d::Work> gather(std::vector<at::Tensor>& outs, at::Tensor& in, int root);
  c10::intrusive_ptr<c10d::Work> scatter(at::Tensor& out, std::vector<at::Tensor>& ins, int root);
  void set_timeout(std::chrono::milliseconds t);
  // Records `why` as the job's failure in the ring: peers waiting in a CUDA op raise it
  // at once (no-op before the first CUDA op, when there is no ring yet).
  void abort(const std::string& why);

 private:
  pycomm::cuda::IpcRing& ring(const at::Tensor& t, const char* op);
  std::vector<pycomm::DType> checked_pairs(const std::vector<at::Tensor>& outs,
                                           const std::vector<at::Tensor>& ins, const char* op,
                                           bool outputs_larger) const;
  void check_root(int root, const char* op) const;
  void check_cuda_list(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* op,
                       const char* what) const;
  template <class F>
  c10::intrusive_ptr<c10d::Work> on_stream(c10d::OpType type, const at::Tensor& t,
                                           std::vector<at::Tensor> outputs, F body);

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<pycomm::cuda::IpcRing> ring_;
};

// Whether any of the tensors is on a CUDA device (then all must be: checked by the op).
bool any_cuda(const std::vector<at::Tensor>& tensors);

}  // namespace pycomm_torch

#endif  // PYCOMM_CUDA
