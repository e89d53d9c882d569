#include "core/communicator/fork_guard.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include "core/communicator/worker.h"
#include "core/memory/arena.h"
#include "core/transport/shared_state.h"
#include "core/transport/unlink_on_signal.h"

namespace pycomm {
namespace {

constexpr int kSlots = 256;
// A claimed slot's fields are written before `used` is set (release).
struct Slot {
  std::atomic<bool> used{false};
  int fd = -1;
  void* addr = nullptr;
  size_t bytes = 0;
};
Slot g_slots[kSlots];
std::mutex g_claim_mu;
// Set in a forked child: until then no group here can be a fork's copy, and every op's
// check needs no getpid() (a system call, a few hundred ns in a VM, on every op).
std::atomic<bool> g_is_fork_child{false};

// The file's open description lives on while any descriptor *or mapping* refers to it,
// and the liveness locks live with it: the child closes its descriptor and replaces
// the mapping by zero pages at the same addresses (nothing reads them: the child's
// copies of the groups refuse every op).
void in_child() {
  g_is_fork_child.store(true, std::memory_order_relaxed);
  for (auto& s : g_slots) {
    if (!s.used.exchange(false)) continue;
    if (s.addr != nullptr)
      mmap(s.addr, s.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (s.fd >= 0) ::close(s.fd);
  }
  Arena::after_fork_in_child();
  Worker::after_fork_in_child();
  forget_all_unlink_on_signal();
  forget_pid_namespace();
}

}  // namespace

void install_fork_guard() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, in_child); });
}

int close_on_fork(int fd, void* addr, size_t bytes) {
  install_fork_guard();
  std::lock_guard<std::mutex> lock(g_claim_mu);
  for (int i = 0; i < kSlots; ++i) {
    Slot& s = g_slots[i];
    if (s.used.load(std::memory_order_acquire)) continue;
    s.fd = fd;
    s.addr = addr;
    s.bytes = bytes;
    s.used.store(true, std::memory_order_release);
    return i;
  }
  return -1;
}

void forget_close_on_fork(int slot) {
  if (slot >= 0 && slot < kSlots) g_slots[slot].used.store(false, std::memory_order_release);
}

std::string forked_group_error(int creator_pid, int rank) {
  if (!g_is_fork_child.load(std::memory_order_relaxed) || getpid() == creator_pid) return "";
  return "pycomm: this process (pid " + std::to_string(getpid()) + ") is a fork of rank " +
         std::to_string(rank) + "'s process (pid " + std::to_string(creator_pid) +
         "): a process group cannot be used across fork() (the child has none of its "
         "threads, and shares its parent's memory). Create groups in the child itself, or "
         "start it with spawn (multiprocessing_context='spawn' for a DataLoader)";
}

}  // namespace pycomm
