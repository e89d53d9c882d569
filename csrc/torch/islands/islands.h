// ProcessGroupIslands: the c10d::Backend "pycomm" attaches when a group spans several
// hosts (islands, as Pathways calls them). Inside an island ranks talk over shared
// memory (a ProcessGroupPycomm of the island's ranks); between islands an existing
// engine carries the data (torch's gloo backend for CPU tensors, created in Python
// from the same store and timeout). pycomm has no network transport of its own.
//
// all_reduce with equal islands (I islands of L ranks):
//   1. reduce-scatter inside the island (shm): local rank j holds shard j, island-reduced
//   2. all-reduce of shard j among the I ranks holding it, one per island (gloo)
//   3. all-gather inside the island (shm)
// so each rank hands 1/L of the message to the network engine. Unequal islands (3 + 1)
// use the island leaders instead: reduce to the leader, all-reduce among leaders,
// broadcast in the island.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "core/base/log.h"
#include "core/communicator/worker.h"
#include "torch/backend/backend.h"

namespace pycomm_torch {

// Who is in which island. Islands are numbered by their lowest rank; members ascend.
struct IslandLayout {
  std::vector<std::vector<int>> members;  // island -> global ranks
  std::vector<int> island_of, local_of;   // global rank -> island, index in it

  static IslandLayout from(const std::vector<int>& island_of);
  int islands() const { return static_cast<int>(members.size()); }
  int world() const { return static_cast<int>(island_of.size()); }
  // Every island has the same number of ranks: the shard scheme applies.
  bool even() const;
  std::string describe() const;  // "2 islands: [0, 1] [2, 3]"
};

// The inter-island engines of one rank, built in Python (pycomm/islands.py).
struct IslandEngines {
  c10::intrusive_ptr<c10d::Backend> world;    // all ranks: p2p, gather/scatter, all_to_all
  c10::intrusive_ptr<c10d::Backend> shard;    // equal islands: local rank j of every island
  c10::intrusive_ptr<c10d::Backend> leaders;  // local rank 0 of every island (leaders only)
};

class ProcessGroupIslands : public c10d::Backend {
 public:
  ProcessGroupIslands(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                      std::chrono::milliseconds timeout, const std::vector<int>& island_of,
                      c10::intrusive_ptr<ProcessGroupPycomm> local, IslandEngines engines);
  ~ProcessGroupIslands() override;

  const std::string getBackendName() const override { return "pycomm"; }
  uint64_t getSequenceNumberForGroup() override { return seq_; }
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

  // Payload bytes this rank has handed to the inter-island engine (inputs of its
  // collectives and sends), since creation or the last reset.
  uint64_t inter_island_bytes() const { return inter_bytes_.load(); }
  void reset_inter_island_bytes() { inter_bytes_.store(0); }
  const IslandLayout& layout() const { return layout_; }
  int island() const { return layout_.island_of[getRank()]; }
  int local_rank() const { return layout_.local_of[getRank()]; }

 private:
  // One composed op, for log lines and error messages.
  struct Op {
    const char* name;
    uint64_t seq;
  };

  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, const char* name,
                                         std::vector<at::Tensor> outputs, bool async_op,
                                         std::function<void(const Op&)> body);
  void check_usable() const;
  std::string fail_on_stall(const std::string& why);
  void log_path(const Op& op, const std::string& path) const;

  // The steps of every algorithm: blocking, on the worker thread.
  void local_step(const Op& op, const char* what, const c10::intrusive_ptr<c10d::Work>& w);
  void remote_step(const Op& op, const char* what, size_t bytes,
                   const std::function<c10::intrusive_ptr<c10d::Work>()>& start);
  [[noreturn]] void fail(const Op& op, const std::string& why);
  std::string island_note(int island) const;

  // The algorithms (islands_collectives.cc): `buf` is contiguous, `op` one gloo knows.
  void all_reduce_flat(const Op& op, at::Tensor buf, const c10d::ReduceOp& rop);
  void reduce_scatter_flat(const Op& op, at::Tensor out, at::Tensor in, const c10d::ReduceOp& rop);
  void all_gather_flat(const Op& op, at::Tensor out, at::Tensor in);
  void broadcast_flat(const Op& op, at::Tensor buf, int root);
  void barrier_steps(const Op& op);
  bool is_leader() const { return local_rank() == 0; }
  int64_t world_order_index(int island, int local) const;

  c10::intrusive_ptr<c10d::Work> point_to_point(bool is_send, at::Tensor t, int peer, int tag);

  IslandLayout layout_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  pycomm::Logger log_;
  c10::intrusive_ptr<ProcessGroupPycomm> local_;
  IslandEngines engines_;
  std::atomic<uint64_t> inter_bytes_{0};
  uint64_t seq_ = 0;    // composed ops issued (caller's thread)
  std::string failed_;  // set on the worker when the group failed; read under mu_
  mutable std::mutex mu_;
  Leftovers leftovers_;
  std::unique_ptr<pycomm::Worker> worker_;
  const int creator_pid_ = static_cast<int>(::getpid());  // a forked child's copy differs
};

}  // namespace pycomm_torch
