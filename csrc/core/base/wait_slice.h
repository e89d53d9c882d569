// A waiting thread's time slice. Linux's EEVDF scheduler (6.6+) picks, among the threads
// owed CPU, the one whose slice ends first, and since 6.12 a SCHED_OTHER thread may ask
// for a shorter slice (sched_setattr's sched_runtime, 0.1-100 ms). It keeps its weight,
// so its share of the core is unchanged; what changes is how soon it runs once woken:
// with its default slice a rank that slept for its peer waited behind every busy thread
// on its core (10-20 ms beside four busy loops, records/collectives/wait-slice), with a
// short one it preempts them when woken. So a rank that goes to sleep for a peer asks for
// a short slice, and takes its own back once awake: while it works, the scheduler's
// slice lets it run longer before a busy thread may preempt it (asking for the short
// slice for the whole op made 1 MB all_reduces beside one busy loop 1.5x slower).
#pragma once

#include <cstdint>

namespace pycomm {

// Shortens the calling thread's slice to `us` microseconds (0: leave it) until
// restore_wait_slice(). Does nothing if the thread's slice is already that short, its
// policy is not SCHED_OTHER or SCHED_BATCH, or the kernel refused once (a seccomp
// filter, no sched_setattr); kernels before 6.12 accept and ignore it.
void shorten_slice_for_wait(uint32_t us);

// Gives the calling thread back the slice it had before shorten_slice_for_wait(),
// keeping whatever else changed meanwhile (its nice value). Cheap when nothing was
// shortened: one thread-local flag.
void restore_wait_slice();

// A short slice for one scope: shorten_slice_for_wait(us) now, restore_wait_slice() when
// the scope ends, by return or by exception. What a wait about to sleep holds.
class ShortSlice {
 public:
  explicit ShortSlice(uint32_t us) { shorten_slice_for_wait(us); }
  ShortSlice(const ShortSlice&) = delete;
  ShortSlice& operator=(const ShortSlice&) = delete;
  ~ShortSlice() { restore_wait_slice(); }
};

}  // namespace pycomm
