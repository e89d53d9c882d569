// Waiting for another rank: spin briefly (cheap when the peer is about to answer), then
// sleep on this rank's doorbell so oversubscribed ranks (4 ranks on 2 cores) leave the
// CPU to the peer they wait for. While asleep it wakes every few milliseconds to check
// the job: the abort record, the deadline, dead peers and ranks that called something
// else for the same sequence number. Every failure is recorded for the whole job.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "futex.h"
#include "shared_state.h"

namespace pycomm {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Waiter {
 public:
  Waiter(const Shared& shared, Lane lane, uint32_t spin)
      : shared_(shared), lane_(lane), spin_(spin) {}

  // Returns once ready() holds. `awaited(std::vector<int>&)` lists the ranks the wait
  // depends on (for liveness checks and messages). Throws CommError on failure.
  template <class Ready, class Awaited>
  void wait(const OpCall& op, Ready ready, Awaited awaited) {
    for (uint32_t i = 0; i < spin_; ++i) {
      if (ready()) return;
      cpu_relax();
    }
    Bell& bell = shared_.bell(shared_.rank(), lane_);
    std::vector<int> who;
    for (;;) {
      uint32_t seen = bell.seq.load(std::memory_order_seq_cst);
      bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
      bool done = ready();
      if (!done) {
        who.clear();
        awaited(who);
        int64_t slice_us = check_or_leave(op, who, &bell);
        futex_wait(&bell.seq, seen, slice_us);
      }
      bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (done || ready()) return;
    }
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
  uint32_t spin_;
  Clock::time_point next_scan_{};
};

}  // namespace pycomm
