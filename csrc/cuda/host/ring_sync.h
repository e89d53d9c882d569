// The host side of the CUDA-IPC ring's synchronisation, torch-free and CUDA-free so that
// CI tests it with real processes and no GPU (tests/test_cuda_ring_sync.py).
//
// The ranks share a small segment (ring_counters.h). Through it a rank
//  - numbers each call (seq) and publishes what it called, so ranks that called
//    different ops are told so (by both) instead of walking plans of different shapes
//    over the same step numbers;
//  - posts the steps it has enqueued and the predecessor's steps it has read, and tags
//    each window slot with the step and call it holds;
//  - records the job's first failure once, for every rank to raise;
//  - holds a liveness lock (liveness.h), so a waiter tells a dead peer from a slow one.
// Every wait follows WaitPolicy: poll, then sleep on this rank's doorbell (woken by the
// change it waits for) in slices of at most WaitPolicy::kCheckEvery, checking between
// slices the abort record, the deadline, the peers' liveness and their calls.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "core/base/types.h"
#include "core/base/wait_policy.h"
#include "core/communicator/rendezvous.h"
#include "core/transport/liveness.h"
#include "core/transport/shared_state.h"
#include "core/transport/shm_segment.h"
#include "cuda/host/ring_counters.h"

namespace pycomm {

struct RingSyncOptions {
  int slots = 4;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  WaitPolicy wait{20, 1000};
};

class RingSync {
 public:
  // Collective: every rank of the group calls it. Rank 0 creates the segment and names
  // it in `rdv`; the name is removed from /dev/shm once every rank has it mapped.
  RingSync(Rendezvous& rdv, int rank, int size, RingSyncOptions opts);
  // Leaves (DRAINED if drained() was called, else LEFT) and unmaps, which releases the
  // liveness lock.
  ~RingSync();
  RingSync(const RingSync&) = delete;
  RingSync& operator=(const RingSync&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int slots() const { return opts_.slots; }
  int prev() const { return (rank_ + size_ - 1) % size_; }
  int next() const { return (rank_ + 1) % size_; }
  void set_timeout(std::chrono::milliseconds t) { opts_.timeout = t; }

  // Numbers the call (1, 2, ... per ring) and publishes it. Throws CommError if the job
  // already failed, or (recording it for everyone) if a peer published another call
  // for one of the last few sequence numbers.
  OpCall begin(OpKind kind, DType dtype, uint64_t count, RedOp op, int root);
  uint64_t seq() const { return seq_; }  // of the last call begun

  // The ring protocol, per step (ring_walk.cc walks a plan with these).
  uint64_t steps() const { return steps_; }  // steps walked so far: the same on every rank
  void advance(uint64_t n) { steps_ += n; }  // after a whole call was walked
  // Waits until the predecessor has posted `step`, then checks the slot's tag: it must
  // hold that step of this same call.
  void wait_posted(const OpCall& call, uint64_t step);
  // Waits until the successor has read this rank's `step`.
  void wait_read(const OpCall& call, uint64_t step);
  // This rank wrote `step` into its window slot step % slots (before post()).
  void wrote(const OpCall& call, uint64_t step);
  // The step this rank last wrote into `slot`, or -1.
  int64_t held(int slot) const;
  // This rank has enqueued its read of the predecessor's `step`.
  void read(uint64_t step);
  // This rank's steps <= `step` are enqueued.
  void post(uint64_t step);

  // The job's failure record: the first failure anywhere wins, every rank raises it.
  void abort(const std::string& why) const;
  [[noreturn]] void fail(const std::string& msg) const;
  // -1 while the job is fine, else the rank whose failure was recorded.
  int failed_by() const;
  std::string abort_message() const;
  // Throws (without recording anything new) if the job already failed.
  void throw_if_failed(const OpCall& call, const char* doing) const;

  // Teardown, where nothing throws and no wait is unbounded.
  // settle(): waits until done() holds (true) or `deadline` passes (false); once the job
  // has failed or a peer died (hurry()), a second at most: device work may then never end.
  bool settle(const std::function<bool()>& done, Clock::time_point deadline) const;
  // This rank no longer uses anything of its neighbours (its device work has finished,
  // it closed what it imported from them).
  void drained();
  // Waits until `peer` is drained or its process is gone (true), or it left without
  // draining or `deadline` passed (false), as settle().
  bool wait_drained(int peer, Clock::time_point deadline) const;
  // Whether the job failed or a peer died: teardown should not wait on device work.
  bool hurry() const;
  // Whether rank r is still there: false once it died or left.
  bool peer_alive(int r) const;

 private:
  struct Awaited {
    int peer;
    const char* verb;  // "post", "read"
    uint64_t step;
  };
  void join(Rendezvous& rdv);
  RingRank* mine() const { return ring_rank(base_, rank_); }
  RingRank* of(int r) const { return ring_rank(base_, r); }
  RingRankState state_of(int r) const;
  void wake(int r) const;
  void wake_everyone() const;
  template <class Ready>
  void wait(const OpCall& call, Ready ready, const Awaited& what);
  void check(const OpCall& call, const Awaited& what);
  void check_peers(const OpCall& call, const Awaited& what) const;
  void check_agreement(const OpCall& call) const;
  void check_tag(const OpCall& call, uint64_t step) const;
  std::string call_of(int r, uint64_t seq) const;
  std::string timeout_message(const OpCall& call, const Awaited& what) const;

  int rank_, size_;
  RingSyncOptions opts_;
  ShmSegment shm_;
  void* base_ = nullptr;
  Liveness liveness_;
  uint64_t seq_ = 0;
  uint64_t steps_ = 0;
  bool drained_ = false;
  Clock::time_point next_scan_{};
};

}  // namespace pycomm
