#include "core/transport/unlink_on_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace pycomm {
namespace {

constexpr int kSlots = 64;
constexpr size_t kNameBytes = 96;  // "/dev/shm" + "/pycomm-<pid>-<16 hex>" fits
constexpr int kSignals[] = {SIGTERM, SIGHUP, SIGQUIT};

// Written by the owning thread, read by the handler: a slot's path is complete
// before its flag is set (release), and the handler reads only flagged slots.
struct Slot {
  std::atomic<bool> used{false};
  char path[kNameBytes] = {0};
};
Slot g_slots[kSlots];
struct sigaction g_previous[sizeof(kSignals) / sizeof(kSignals[0])];

// Only async-signal-safe calls: unlink(2) of each path, then the previous handler.
void on_fatal_signal(int sig, siginfo_t* info, void* ctx) {
  int saved_errno = errno;
  for (auto& s : g_slots) {
    if (s.used.exchange(false, std::memory_order_acq_rel)) ::unlink(s.path);
  }
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
    if (kSignals[i] != sig) continue;
    const struct sigaction& prev = g_previous[i];
    if (prev.sa_flags & SA_SIGINFO) {
      prev.sa_sigaction(sig, info, ctx);
    } else if (prev.sa_handler == SIG_IGN) {
      // ignored before us: stays ignored
    } else if (prev.sa_handler == SIG_DFL) {
      sigaction(sig, &prev, nullptr);  // the default again, then the signal as sent
      raise(sig);
    } else {
      prev.sa_handler(sig);
    }
  }
  errno = saved_errno;
}

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
      struct sigaction sa{};
      sa.sa_sigaction = on_fatal_signal;
      sa.sa_flags = SA_SIGINFO | SA_RESTART;
      sigemptyset(&sa.sa_mask);
      sigaction(kSignals[i], &sa, &g_previous[i]);
    }
  });
}

}  // namespace

int unlink_on_signal(const std::string& shm_name) {
  std::string path = "/dev/shm" + shm_name;
  if (path.size() >= kNameBytes) return -1;
  install_once();
  static std::mutex mu;  // slots are claimed by threads; the handler never takes it
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < kSlots; ++i) {
    Slot& s = g_slots[i];
    if (s.used.load(std::memory_order_acquire)) continue;
    std::memcpy(s.path, path.c_str(), path.size() + 1);
    s.used.store(true, std::memory_order_release);
    return i;
  }
  return -1;
}

void forget_unlink_on_signal(int slot) {
  if (slot >= 0 && slot < kSlots) g_slots[slot].used.store(false, std::memory_order_release);
}

void forget_all_unlink_on_signal() {
  for (auto& s : g_slots) s.used.store(false, std::memory_order_release);
}

}  // namespace pycomm
