#include "core/base/wait_slice.h"

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace pycomm {
namespace {

// The kernel's struct sched_attr (uapi/linux/sched/types.h), SCHED_ATTR_SIZE_VER1. glibc
// declares no wrapper for it before 2.41, so it is spelled here.
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;  // SCHED_OTHER/BATCH: the requested slice in ns (0: the default)
  uint64_t sched_deadline;
  uint64_t sched_period;
  uint32_t sched_util_min;
  uint32_t sched_util_max;
};

// Only this flag survives a get/set round trip: the utilisation clamps are left out, so
// the kernel keeps the thread's own.
constexpr uint64_t kResetOnFork = 0x01;  // SCHED_FLAG_RESET_ON_FORK

struct ThreadSlice {
  bool shortened = false;  // this thread's slice is ours until restore_wait_slice()
  bool refused = false;    // the kernel said no once: never ask again on this thread
  uint64_t saved_ns = 0;   // its slice before (sched_getattr's sched_runtime)
};
thread_local ThreadSlice tls_slice;

bool get_attr(SchedAttr* a) {
  std::memset(a, 0, sizeof(*a));
  return syscall(SYS_sched_getattr, 0, a, sizeof(*a), 0) == 0;
}

// Sets only the slice: policy, nice and reset-on-fork are the thread's current ones.
bool set_slice(SchedAttr a, uint64_t slice_ns) {
  a.size = sizeof(a);
  a.sched_flags &= kResetOnFork;
  a.sched_runtime = slice_ns;
  a.sched_deadline = a.sched_period = 0;
  return syscall(SYS_sched_setattr, 0, &a, 0) == 0;
}

}  // namespace

void shorten_slice_for_wait(uint32_t us) {
  ThreadSlice& s = tls_slice;
  if (us == 0 || s.shortened || s.refused) return;
  SchedAttr cur;
  if (!get_attr(&cur)) {
    s.refused = true;
    return;
  }
  if (cur.sched_policy != SCHED_OTHER && cur.sched_policy != SCHED_BATCH) return;
  const uint64_t want = uint64_t{us} * 1000;
  if (cur.sched_runtime != 0 && cur.sched_runtime <= want) return;
  if (!set_slice(cur, want)) {
    s.refused = true;
    return;
  }
  s.saved_ns = cur.sched_runtime;
  s.shortened = true;
}

// The slice goes back by value: sched_getattr reports the scheduler's default as a
// number, so a thread that had the default keeps the same length as its own request
// (it no longer follows a later change of the system-wide default).
void restore_wait_slice() {
  ThreadSlice& s = tls_slice;
  if (!s.shortened) return;
  s.shortened = false;
  SchedAttr cur;
  if (!get_attr(&cur)) return;
  // A policy set meanwhile (real-time) owns the thread now; its slice is not ours to set.
  if (cur.sched_policy == SCHED_OTHER || cur.sched_policy == SCHED_BATCH)
    set_slice(cur, s.saved_ns);
}

}  // namespace pycomm
