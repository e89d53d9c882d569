#include "core/transport/shared_state.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/base/futex.h"

namespace pycomm {
namespace {

// The abort flag: 0, or (rank + 1) << 2 | phase, phase 1 = claimed, 2 = message written.
constexpr uint32_t kClaimed = 1, kPublished = 2;
uint32_t abort_word(int rank, uint32_t phase) {
  return (static_cast<uint32_t>(rank) + 1) << 2 | phase;
}

}  // namespace

namespace {
std::atomic<uint64_t> g_pid_namespace{0};  // 0: not read yet (or unreadable)
}  // namespace

// A process's PID namespace never changes (unshare and setns move only the children it
// starts afterwards), so it is read once: a stat() of /proc on every op that negotiates
// zero-copy cost 4-6 us per op, more than a 64 KB all_reduce itself (bench.algo_crossover).
// A forked child may be in another namespace: the fork guard forgets it there.
uint64_t pid_namespace_id() {
  uint64_t ns = g_pid_namespace.load(std::memory_order_relaxed);
  if (ns != 0) return ns;
  struct stat st;
  ns = stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
  g_pid_namespace.store(ns, std::memory_order_relaxed);
  return ns;
}

void forget_pid_namespace() { g_pid_namespace.store(0, std::memory_order_relaxed); }

void Shared::join() {
  liveness_ = Liveness(segment_.fd(), rank_);
  RankControl* me = control(rank_);
  me->pid.store(static_cast<int32_t>(getpid()), std::memory_order_relaxed);
  me->pid_ns.store(pid_namespace_id(), std::memory_order_relaxed);
  me->state.store(static_cast<uint32_t>(RankState::ALIVE), std::memory_order_release);
}

void Shared::depart(Departure how) {
  auto state = how == Departure::DESTROYED ? RankState::DEPARTED : RankState::EXITED;
  control(rank_)->state.store(static_cast<uint32_t>(state), std::memory_order_release);
  ring_everyone(COLL);
  ring_everyone(P2P);
}

// The caller has just changed something rank r may wait for. A Dekker handshake with
// the waiter (Waiter::wait): we fence, then read `sleepers`; it increments `sleepers`,
// fences, then re-checks its condition. Either it sees our change and does not sleep,
// or we see it counted and bump `seq` (which its futex_wait compares) and wake it. The
// bell's line is written only when someone sleeps, so ringing an awake peer is a read
// of a line both cores keep, not a read-modify-write that moves it between them.
void Shared::ring(int r, Lane lane) const {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  wake_if_asleep(bell(r, lane));
}

// ring() for every other rank, behind one fence.
void Shared::ring_others(Lane lane) const { ring_all(lane, rank_); }

void Shared::ring_everyone(Lane lane) const { ring_all(lane, -1); }

void Shared::ring_all(Lane lane, int except) const {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int r = 0; r < world_; ++r)
    if (r != except) wake_if_asleep(bell(r, lane));
}

void Shared::wake_if_asleep(Bell& b) {
  if (b.sleepers.load(std::memory_order_seq_cst) == 0) return;
  b.seq.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&b.seq);
}

bool Shared::aborted() const { return header()->abort_flag.load(std::memory_order_acquire) != 0; }

std::string Shared::abort_message() const {
  const SegmentHeader* h = header();
  // The claiming rank writes the message right after claiming; give it a moment.
  uint32_t flag = h->abort_flag.load(std::memory_order_acquire);
  for (int i = 0; i < 200 && (flag & 3) == kClaimed; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(500));
    flag = h->abort_flag.load(std::memory_order_acquire);
  }
  // The word and the message are in the segment any process of this user may write:
  // a word that names no rank of the group is said to be that, not decoded as one.
  const int64_t claimed = static_cast<int64_t>(flag >> 2) - 1;
  if (claimed < 0 || claimed >= world_ || ((flag & 3) != kClaimed && (flag & 3) != kPublished)) {
    return "the group's failure record reads " + std::to_string(flag) +
           ", which names no rank of the " + std::to_string(world_) +
           ": the shared segment was written by something other than pycomm";
  }
  if ((flag & 3) == kPublished) {
    std::string msg(h->abort_msg, strnlen(h->abort_msg, sizeof(h->abort_msg)));
    for (char& c : msg) {  // pycomm writes ASCII: other bytes are not its message
      const auto u = static_cast<unsigned char>(c);
      if ((u < 0x20 && c != '\n' && c != '\t') || u >= 0x7f) c = '?';
    }
    return msg;
  }
  return "rank " + std::to_string(claimed) + " failed, and exited before it could say why";
}

void Shared::set_abort(const std::string& msg) const {
  SegmentHeader* h = header();
  uint32_t expected = 0;
  if (h->abort_flag.compare_exchange_strong(expected, abort_word(rank_, kClaimed),
                                            std::memory_order_acq_rel)) {
    std::snprintf(h->abort_msg, sizeof(h->abort_msg), "%s", msg.c_str());
    h->abort_rank = rank_;
    h->abort_flag.store(abort_word(rank_, kPublished), std::memory_order_release);
  }
  ring_everyone(COLL);
  ring_everyone(P2P);
}

namespace {
// How a rank that left cleanly left, or "" while it is still in the group.
std::string departure(int r, RankState state) {
  if (state == RankState::DEPARTED)
    return "rank " + std::to_string(r) + " left the group (destroy_process_group)";
  if (state == RankState::EXITED) {
    return "rank " + std::to_string(r) +
           " let go of the group without destroy_process_group (its process exited, or "
           "dropped the group, while this rank still waited for it)";
  }
  return "";
}
}  // namespace

std::string Shared::peer_gone(int r) const {
  auto state = static_cast<RankState>(control(r)->state.load(std::memory_order_acquire));
  if (state == RankState::ABSENT) return "";
  if (std::string how = departure(r, state); !how.empty()) return how;
  if (liveness_.alive(r)) return "";
  // Read the state again: a rank that departs releases its lock right after.
  state = static_cast<RankState>(control(r)->state.load(std::memory_order_acquire));
  if (std::string how = departure(r, state); !how.empty()) return how;
  std::string pid = std::to_string(control(r)->pid.load(std::memory_order_relaxed));
  if (!same_pid_namespace(r)) pid += " in another PID namespace";
  return "rank " + std::to_string(r) + " (pid " + pid + ") died";
}

bool Shared::same_pid_namespace(int r) const {
  uint64_t mine = control(rank_)->pid_ns.load(std::memory_order_relaxed);
  return mine != 0 && control(r)->pid_ns.load(std::memory_order_relaxed) == mine;
}

void Shared::reserve_channel(Lane lane, int dst, uint32_t buffers) const {
  Extent e = layout_.channel_head(lane, rank_, dst, buffers);
  segment_.reserve(e.offset, e.bytes,
                   std::string(lane == COLL ? "the collective" : "the send/recv") +
                       " channel from rank " + std::to_string(rank_) + " to rank " +
                       std::to_string(dst));
}

void Shared::reserve_stage_areas() const {
  Extent e = layout_.stage_extent(rank_);
  segment_.reserve(e.offset, e.bytes,
                   "the two-shot's stage areas of rank " + std::to_string(rank_));
}

// A channel grows only while /dev/shm keeps this much free besides: other groups, the
// arena and other jobs on the host need it more than this channel needs depth.
constexpr size_t kKeepShmFree = size_t{256} << 20;

bool Shared::try_reserve_buffer(Lane lane, int dst, uint32_t b) const {
  Extent e = layout_.buffer_extent(lane, rank_, dst, b);
  return segment_.try_reserve(e.offset, e.bytes, kKeepShmFree);
}

std::string where(const OpCall& op, int rank) {
  std::string s = describe(op.desc);
  if (op.lane == COLL) s += " (seq " + std::to_string(op.desc.seq) + ")";
  return s + " on rank " + std::to_string(rank);
}

}  // namespace pycomm
