// ProcessGroupPycomm: the c10d::Backend that `init_process_group("pycomm")` attaches for
// CPU tensors. Each call checks its tensors at once (errors raise in the caller), then
// queues the op on the collective worker (or the send/recv engine) and returns a Work.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <tuple>
#include <vector>

#include "core/communicator/communicator.h"
#include "core/communicator/worker.h"
#include "core/transport/p2p_engine.h"
#include "torch/backend/stripes.h"
#include "torch/backend/work.h"
#include "torch/cuda/cuda_collectives.h"  // empty unless PYCOMM_CUDA

namespace pycomm_torch {

// What a finished op still references: its Work (with the output tensors) and the
// closure that ran it (with the input tensors). Dropping the last reference to a tensor
// Python also sees needs the GIL, and a C++ thread that takes the GIL while Python is
// finalizing is ended inside that destructor (std::terminate). So the worker and the
// send/recv engine never drop these: they park them here, and the caller's thread drops
// them on its next call, or at shutdown.
class Leftovers {
 public:
  void park(c10::intrusive_ptr<c10d::Work> work, std::function<void()> body = {},
            std::shared_ptr<void> extra = {});
  void drop_all();

 private:
  struct Entry {
    c10::intrusive_ptr<c10d::Work> work;
    std::function<void()> body;
    std::shared_ptr<void> extra;
  };
  std::mutex mu_;
  std::vector<Entry> entries_;
  std::atomic<bool> any_{false};  // entries_ is not empty (read without the lock)
};

struct ReduceSpec;  // tensor_args.h
}  // namespace pycomm_torch

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace pycomm_torch {

// "sum", "avg", "prod", "min", "max" as c10d's ReduceOp; a clear error otherwise.
c10d::ReduceOp reduce_op_named(const std::string& op);

// A synchronous all_reduce over any group, no Work (custom_ops.cc): the kernel of
// torch.ops.pycomm.all_reduce_ and pycomm.all_reduce_'s eager entry.
void all_reduce_on(at::Tensor& tensor, const std::string& op, c10d::ProcessGroup& group);

// `group` if torch.distributed still has it registered under its name; a clear error for
// a destroyed group (the torch.ops path resolves groups by name, so it refuses those too).
c10::intrusive_ptr<c10d::ProcessGroup> live_group(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group);

class ProcessGroupPycomm : public c10d::Backend {
 public:
  ProcessGroupPycomm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout);
  ~ProcessGroupPycomm() override;

  const std::string getBackendName() const override { return "pycomm"; }
  uint64_t getSequenceNumberForGroup() override { return comm_ ? comm_->seq() : 0; }
  void setSequenceNumberForGroup() override {}
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void abort() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // pycomm's native path: a blocking all_reduce of a contiguous CPU tensor on the
  // calling thread, without torch's dispatcher or a Work object (what mpi4py is to MPI).
  // Ordered with queued ops: it waits for them first.
  void all_reduce_now(at::Tensor& t, const std::string& op);
  // allreduce's checks and body on the calling thread, with no Work (synchronous CPU
  // calls: all_reduce_now and the torch.ops.pycomm.all_reduce_ custom op).
  void all_reduce_direct(at::Tensor& t, const c10d::ReduceOp& op);
  void barrier_now();
  // Expert parallelism's dispatch as one op (counted.cc): the rows of `input`, sent
  // `send_counts` (int64, world x groups: rows per peer and per group of that peer, in
  // the order `input` holds them) to each peer, received with the counts learned in the
  // op. Returns the received rows (source-major) and their counts (world x groups).
  // Synchronous, in the group's order with queued ops.
  std::tuple<at::Tensor, at::Tensor> all_to_all_counted(const at::Tensor& input,
                                                        const at::Tensor& send_counts);

  // Bytes of shared memory this group's segment takes (for logs and tests).
  size_t segment_bytes() const { return comm_ ? comm_->segment_bytes() : 0; }
  // Marks the group failed with `msg` (an islands group whose other half failed):
  // ranks waiting in a collective raise it at once, as they do after a timeout.
  void fail_with(const std::string& msg);

 private:
  // all_reduce_direct's CPU body on the calling thread; false when it must queue.
  bool try_all_reduce_inline(at::Tensor& t, const c10d::ReduceOp& op);
  // A Work already finished with `output` (an op that ran in the caller's thread).
  c10::intrusive_ptr<c10d::Work> finished_work(c10d::OpType type, const char* title,
                                               const at::Tensor& output);
  // Runs `body` in call order and completes the Work: on the collective worker, or
  // right here when the op is synchronous and nothing is queued before it.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* title,
                                         std::vector<at::Tensor> outputs, bool async_op,
                                         std::function<void()> body);
  c10::intrusive_ptr<c10d::Work> point_to_point(bool is_send, at::Tensor t, int peer, int tag);
  c10::intrusive_ptr<c10d::Work> all_gather_uneven(std::vector<at::Tensor> outs, at::Tensor in,
                                                   pycomm::DType dt, bool async_op);
  void reduce_in_place(const at::Tensor& t, pycomm::DType dt, const ReduceSpec& rs);
  // The core all_reduce of a flat buffer, striped when the group has stripes and it is
  // large enough (stripes.h).
  void all_reduce_flat(void* data, size_t count, pycomm::DType dt, pycomm::RedOp op);
  void complete_p2p(const c10::intrusive_ptr<PycommWork>& work, std::exception_ptr error,
                    std::shared_ptr<void> staged);
  pycomm::Communicator& comm();
  // Refuses a new op once shutdown began (destroy_process_group, or the destructor).
  void check_open() const;
  void close(pycomm::Departure how);
#ifdef PYCOMM_CUDA
  CudaCollectives& cuda();  // throws, like comm(), once the group was shut down
#endif
  void check_peer(int peer, const char* op) const;

  Leftovers leftovers_;  // declared first: destroyed after the threads that park in it
#ifdef PYCOMM_CUDA
  std::unique_ptr<CudaCollectives> cuda_;  // CUDA tensors: the CUDA-IPC ring
#endif
  std::unique_ptr<pycomm::Communicator> comm_;
  std::unique_ptr<Stripes> stripes_;  // PYCOMM_STRIPES > 1: more communicators for all_reduce
  std::unique_ptr<pycomm::P2PEngine> p2p_;
  std::unique_ptr<pycomm::Worker> worker_;
  // Completes p2p Works whose future was asked for (started on first need).
  std::unique_ptr<pycomm::Worker> p2p_callbacks_;
  std::once_flag p2p_callbacks_once_;
  std::atomic<bool> closing_{false};
  const int creator_pid_ = static_cast<int>(::getpid());  // a forked child's copy differs
};

}  // namespace pycomm_torch
