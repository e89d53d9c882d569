// Striping: a torch group's large CPU all_reduce cut into contiguous parts, each run by
// its own communicator on its own thread (PYCOMM_STRIPES, PYCOMM_STRIPE_BYTES).
//
// Why: a rank that shares its core with busy threads gets the scheduler's fair share
// per thread. One thread per rank gets 1/(K+1) of a core beside K busy loops, and each
// time it is preempted mid-op its peer waits for it (four ticks, 16 ms, beside four
// loops); gloo's several threads per rank get several shares. Four pycomm groups per
// rank took 4.8-18 ms for a 32 MB all_reduce beside four busy loops per CPU against
// 20-28 ms for one (records/collectives/sched-share/lanes-cpu4-32M.txt). With a core per
// rank and nothing else running, more threads than cores only contend: opt-in.
//
// Every rank decides alike: the group's settings are rank 0's (group_segment.h), and
// the cut depends only on the element count and dtype, which the group's own
// communicator checks on part 0. A part that fails fails every stripe's group record, so
// every rank's every part raises at once instead of waiting out its timeout.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "core/communicator/communicator.h"

namespace pycomm_torch {

// Where part `i` of `n` of `count` elements of `elem_size` bytes starts; parts are
// whole cache lines (64 bytes) except the last, and part n ends at `count`.
size_t stripe_start(size_t count, size_t elem_size, size_t n, size_t i);

// One extra communicator of a group and the thread that runs its parts.
class Stripe {
 public:
  // Stripe `index` (1..) of its group; its thread is named "pycomm-stripe<index>".
  Stripe(int index, pycomm::Rendezvous& rdv, int rank, int world, const pycomm::Config& cfg,
         std::chrono::milliseconds timeout);
  ~Stripe();  // stop(), then the communicator is left (departed) as it is destroyed
  Stripe(const Stripe&) = delete;
  Stripe& operator=(const Stripe&) = delete;

  pycomm::Communicator& comm() { return *comm_; }
  // Runs `part` on the stripe's thread (it must not throw). One at a time: the group
  // waits for every part of an op before it starts the next.
  void run(std::function<void()> part);
  // Joins the thread once its part (if any) is done; idempotent.
  void stop();

 private:
  void loop();

  std::unique_ptr<pycomm::Communicator> comm_;
  uint32_t wait_slice_us_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> part_;
  bool stopping_ = false;
  std::thread thread_;
};

class Stripes {
 public:
  // The group's own communicator `own` is stripe 0; the group's settings (rank 0's) say
  // how many more there are. Each rendezvouses through `store` under its own prefix.
  Stripes(const c10::intrusive_ptr<c10d::Store>& store, pycomm::Communicator& own,
          std::chrono::milliseconds timeout);
  ~Stripes();

  size_t count() const { return extra_.size() + 1; }
  // `own.all_reduce` of the whole buffer, cut over every stripe when splits(): part 0
  // here, on the calling thread, the rest on their stripes' threads; returns when all
  // are done, and rethrows the first failure after failing every stripe's group.
  void all_reduce(void* data, size_t count, pycomm::DType dtype, pycomm::RedOp op);
  // Fails every stripe's group with `msg` (abort, a timeout elsewhere, islands).
  void fail_all(const std::string& msg);
  void set_timeout(std::chrono::milliseconds t);
  // Joins the threads and leaves the extra groups, telling peers `how`.
  void close(pycomm::Departure how);
  // A forked child's copy: the threads are the parent's; nothing is joined or departed.
  void forget_after_fork();

 private:
  struct Pending;
  // Whether an all_reduce of `bytes` is striped (the same answer on every rank).
  bool splits(size_t bytes) const;
  // An all_reduce too small to stripe, on the group's own communicator.
  void whole(void* data, size_t count, pycomm::DType dtype, pycomm::RedOp op);
  // Part `index` of `of` of an op of `whole` elements: `count` from element `first`.
  struct Part {
    size_t index, of, whole, first, count;
    char* data;
  };
  std::string describe(const Part& part) const;  // what a failure of it is prefixed with
  // Runs one part; a failure is recorded (the first one fails every stripe's group).
  void run_part(Pending& p, const Part& part, const std::function<void()>& body);
  template <class Error>
  void record_failure(Pending& p, const Error& error);

  pycomm::Communicator& own_;
  size_t min_bytes_;
  std::vector<std::unique_ptr<Stripe>> extra_;
};

}  // namespace pycomm_torch
