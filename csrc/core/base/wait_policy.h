// The one waiting policy of the library: how every wait for another rank (the shared-
// memory collectives' Waiter, the send/recv engine, the CUDA ring's host side) spends
// its time. Poll briefly (cheap when the peer is about to answer), then poll while
// yielding the core (so an oversubscribed peer, 4 ranks on 2 cores, gets to run), then
// sleep in slices. On a core another job keeps busy the yielding phase is skipped: a
// yield there costs that job's whole time slice, while a sleeper is woken at once.
// Waking a sleeping thread costs tens to hundreds of microseconds (more in a VM), so
// short waits must never sleep. Between slices the waiter checks the job: the abort
// record, the deadline, dead peers. Both polling phases are time-based: how long one
// `pause` takes differs 40x between CPU generations.
#pragma once

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace pycomm {

using Clock = std::chrono::steady_clock;

// Clock::now() read from the kernel's last tick (CLOCK_MONOTONIC_COARSE, the clock
// steady_clock reads finely): up to a few ms behind, and several times cheaper. For
// stamps taken on every op that only timeouts of seconds compare against.
inline Clock::time_point coarse_now() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return Clock::time_point(std::chrono::duration_cast<Clock::duration>(
      std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec)));
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

struct WaitPolicy {
  // How often a sleeping waiter looks at the job (abort, deadline, dead peers), and so
  // the longest it sleeps at once.
  static constexpr auto kCheckEvery = std::chrono::milliseconds(20);

  Clock::duration spin{};
  Clock::duration yield{};
  uint32_t sleep_slice_us = 0;  // the slice a sleeper asks for (wait_slice.h); 0: its own

  WaitPolicy() = default;
  WaitPolicy(uint32_t spin_us, uint32_t yield_us, uint32_t slice_us = 0)
      : spin(std::chrono::microseconds(spin_us)),
        yield(std::chrono::microseconds(std::max(spin_us, yield_us))),
        sleep_slice_us(slice_us) {}

  // The two polling phases; true once ready() holds, false when it is time to sleep.
  // `no_spin`: skip the first phase (another rank waits on this CPU, so the peer we
  // wait for cannot run until we give the core up); its yields hand the core to that
  // rank, so however long they take they go on. Otherwise the second phase is skipped
  // while this thread's core is busy with other jobs (see kLateYield).
  // `yield_core` is sched_yield but in tests (_C._wait_policy_yields).
  template <class Ready, class Yield = int (*)()>
  bool poll(Ready ready, bool no_spin = false, Yield yield_core = &sched_yield) const {
    const auto start = Clock::now();
    const auto spin_for = no_spin ? Clock::duration::zero() : spin;
    while (Clock::now() - start < spin_for) {
      for (int i = 0; i < 32; ++i) {
        if (ready()) return true;
        cpu_relax();
      }
    }
    if (!no_spin && contended()) return false;
    while (Clock::now() - start < yield) {
      if (ready()) return true;
      const auto before = Clock::now();
      yield_core();
      // A yield that came back late gave the core to another job's thread: on a busy
      // core each yield costs that thread's whole time slice (milliseconds), while a
      // sleeper woken by its peer's doorbell is run at once. So stop yielding and sleep.
      if (!no_spin && Clock::now() - before > kLateYield) {
        contended_until() = Clock::now() + kRememberContention;
        return ready();
      }
    }
    return false;
  }

  // A yield on an idle core returns in about a microsecond; past this, another thread ran.
  static constexpr auto kLateYield = std::chrono::microseconds(50);
  // How long a late yield marks this thread's core as busy: waits in that time sleep
  // right after the spin. Load changes slowly beside an op's microseconds.
  static constexpr auto kRememberContention = std::chrono::milliseconds(100);

  // Until when this thread's waits skip the yielding phase (a late yield was seen).
  static Clock::time_point& contended_until() {
    static thread_local Clock::time_point until{};
    return until;
  }
  static bool contended() { return Clock::now() < contended_until(); }

  // How long to sleep before looking again: a slice, never past the deadline.
  static int64_t sleep_us(Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
    auto slice = std::chrono::duration_cast<std::chrono::microseconds>(kCheckEvery);
    return std::max<int64_t>(1, std::min<int64_t>(slice.count(), left.count()));
  }

  // `start + timeout`, saturated: "no timeout" (timedelta.max) must not wrap around
  // into the past and time out every op at once.
  static Clock::time_point deadline_after(Clock::time_point start, std::chrono::milliseconds t) {
    const auto room =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - start);
    return t >= room ? Clock::time_point::max() : start + t;
  }
};

}  // namespace pycomm
