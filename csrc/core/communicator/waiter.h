// Waiting for another rank over the shared segment, by the library's one WaitPolicy
// (wait_policy.h): poll, poll while yielding, then sleep on this rank's doorbell. While
// asleep it wakes every few milliseconds to check the job: the abort record, the
// deadline, dead peers and ranks that called something else for the same sequence
// number. Every failure is recorded for the whole job.
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/base/futex.h"
#include "core/base/wait_policy.h"
#include "core/base/wait_slice.h"
#include "core/transport/shared_state.h"

namespace pycomm {

class Waiter {
 public:
  Waiter(const Shared& shared, Lane lane, WaitPolicy policy)
      : shared_(shared), lane_(lane), policy_(policy) {}

  // Returns once ready() holds. `awaited(std::vector<int>&)` lists the ranks the wait
  // depends on (for liveness checks and messages). Throws CommError on failure.
  template <class Ready, class Awaited>
  void wait(const OpCall& op, Ready ready, Awaited awaited) {
    if (ready()) return;
    if (policy_.poll(ready, shares_cpu_with_a_peer())) return;
    Bell& bell = shared_.bell(shared_.rank(), lane_);
    // Woken by the peer, run at once rather than after the core's busy threads; awake,
    // it runs on with its own slice (a short one would be preempted sooner while it works).
    ShortSlice asleep(policy_.sleep_slice_us);
    std::vector<int> who;
    for (;;) {
      uint32_t seen = bell.prepare_sleep();
      bool done = ready();
      if (!done) {
        who.clear();
        awaited(who);
        int64_t slice_us = check_or_leave(op, who, &bell);
        futex_wait(&bell.seq, seen, slice_us);
      }
      bell.done_sleeping();
      if (done || ready()) return;
    }
  }

  // Spinning is skipped when another rank last waited on this CPU: the scheduler has
  // put us on one core, so the peer we wait for cannot run until we give the core up.
  // Publishes this rank's CPU; true if another rank of the group last waited on it.
  bool shares_cpu_with_a_peer() const {
    const int cpu = sched_getcpu();
    // Stored only when it changes: peers read this line whenever they start to wait.
    auto& mine = shared_.control(shared_.rank())->cpu;
    if (mine.load(std::memory_order_relaxed) != cpu) mine.store(cpu, std::memory_order_relaxed);
    for (int r = 0; r < shared_.world(); ++r) {
      if (r != shared_.rank() && shared_.control(r)->cpu.load(std::memory_order_relaxed) == cpu)
        return true;
    }
    return false;
  }

  // Records `msg` as the job's failure and throws it.
  [[noreturn]] void fail(const std::string& msg) const;

  // Throws if the job has already failed somewhere (used before starting an op).
  void throw_if_aborted(const OpCall& op) const;

 private:
  // Checks the job; throws (leaving the sleepers count as found) or returns how long
  // to sleep before looking again.
  int64_t check_or_leave(const OpCall& op, const std::vector<int>& who, Bell* bell);
  void check(const OpCall& op, const std::vector<int>& who);
  void check_agreement(const OpCall& op) const;
  std::string timeout_message(const OpCall& op, const std::vector<int>& who) const;

  const Shared& shared_;
  Lane lane_;
  WaitPolicy policy_;
  Clock::time_point next_scan_{};
};

}  // namespace pycomm
