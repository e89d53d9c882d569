#include "core/transport/shared_state.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "core/runtime/futex.h"

namespace pycomm {

void Shared::ring(int r, Lane lane) const {
  Bell& b = bell(r, lane);
  // seq_cst pairs with the waiter's sleepers increment (see Waiter): either it sees
  // our change before sleeping, or we see it asleep and wake it.
  b.seq.fetch_add(1, std::memory_order_seq_cst);
  if (b.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&b.seq);
}

void Shared::ring_everyone(Lane lane) const {
  for (int r = 0; r < world_; ++r) ring(r, lane);
}

bool Shared::aborted() const { return header()->abort_flag.load(std::memory_order_acquire) == 2; }

std::string Shared::abort_message() const {
  const SegmentHeader* h = header();
  return std::string(h->abort_msg, strnlen(h->abort_msg, sizeof(h->abort_msg)));
}

void Shared::set_abort(const std::string& msg) const {
  SegmentHeader* h = header();
  uint32_t expected = 0;
  // 0 -> 1 claims the record, 1 -> 2 publishes it once the text is written.
  if (h->abort_flag.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    std::snprintf(h->abort_msg, sizeof(h->abort_msg), "%s", msg.c_str());
    h->abort_rank = rank_;
    h->abort_flag.store(2, std::memory_order_release);
  }
  ring_everyone(COLL);
  ring_everyone(P2P);
}

bool Shared::peer_alive(int r) const {
  int pid = control(r)->pid.load(std::memory_order_acquire);
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed child stays a zombie until its parent reaps it; it is dead all the same.
  // comm, the second field, is "(name)" and may hold spaces: the state follows the last ')'.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (std::getline(stat, line)) {
    size_t close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size()) {
      char state = line[close + 2];
      return state != 'Z' && state != 'X';
    }
  }
  return true;
}

std::string where(const OpCall& op, int rank) {
  std::string s = describe(op.desc);
  if (op.lane == COLL) s += " (seq " + std::to_string(op.desc.seq) + ")";
  return s + " on rank " + std::to_string(rank);
}

}  // namespace pycomm
