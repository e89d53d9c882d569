#include "cuda/host/ring_sync.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/base/errors.h"
#include "core/base/futex.h"
#include "core/base/wait_slice.h"

namespace pycomm {
namespace {

std::string key(const char* what, int rank) {
  return "pycomm/cuda/" + std::string(what) + "/" + std::to_string(rank);
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", s);
  return buf;
}

// A torn or missing descriptor reads as "nothing": only whole ones are compared.
bool load_any(const PackedDesc& d, OpDesc* out) {
  return d.load(d.w[0].load(std::memory_order_acquire), out) && out->seq != 0;
}

}  // namespace

RingSync::RingSync(Rendezvous& rdv, int rank, int size, RingSyncOptions opts)
    : rank_(rank), size_(size), opts_(opts) {
  if (opts_.slots < 2 || opts_.slots > kMaxRingSlots) {
    throw InvalidArgument("pycomm: the CUDA ring needs 2 to " + std::to_string(kMaxRingSlots) +
                          " slots, got " + std::to_string(opts_.slots));
  }
  join(rdv);
}

// Rank 0 creates and describes the segment; each rank maps it, takes its liveness lock,
// and says so; rank 0 removes the name once all have (a crash before that leaves no file:
// the ShmSegment of a failed constructor unlinks it).
void RingSync::join(Rendezvous& rdv) {
  const size_t bytes = ring_counters_bytes(size_);
  if (rank_ == 0) {
    shm_ = ShmSegment::create(bytes, bytes, "the CUDA ring's counters");
    RingHeader* h = ring_header(shm_.data());
    h->magic = kRingMagic;
    h->world = size_;
    h->slots = static_cast<uint32_t>(opts_.slots);
    rdv.set(key("counters", 0), shm_.name());
  } else {
    shm_ = ShmSegment::open(rdv.get(key("counters", 0)), bytes);
  }
  base_ = shm_.data();
  const RingHeader* h = ring_header(base_);
  if (h->magic != kRingMagic || h->world != size_) {
    throw CommError("pycomm: rank " + std::to_string(rank_) + ": segment " + shm_.name() +
                    " is not the CUDA ring's counters for " + std::to_string(size_) + " ranks");
  }
  if (static_cast<int>(h->slots) != opts_.slots) {
    throw CommError("pycomm: rank 0's CUDA ring has " + std::to_string(h->slots) + " slots, rank " +
                    std::to_string(rank_) + "'s " + std::to_string(opts_.slots) +
                    " (PYCOMM_CUDA_SLOTS differs between ranks?)");
  }
  liveness_ = Liveness(shm_.fd(), rank_);
  mine()->state.store(static_cast<uint32_t>(RingRankState::JOINED), std::memory_order_release);
  rdv.set(key("mapped", rank_), "1");
  if (rank_ == 0) {
    for (int r = 1; r < size_; ++r) rdv.get(key("mapped", r));
    shm_.unlink();
  }
}

RingSync::~RingSync() {
  if (!base_) return;
  auto left = drained_ ? RingRankState::DRAINED : RingRankState::LEFT;
  mine()->state.store(static_cast<uint32_t>(left), std::memory_order_release);
  wake_everyone();
  // ~ShmSegment unmaps and closes: the liveness lock goes with the descriptor.
}

RingRankState RingSync::state_of(int r) const {
  return static_cast<RingRankState>(of(r)->state.load(std::memory_order_acquire));
}

// seq_cst pairs with the sleeper's increment (see wait): either it sees the change
// before sleeping, or the waker sees it asleep and wakes it.
void RingSync::wake(int r) const {
  Bell& b = of(r)->bell;
  b.seq.fetch_add(1, std::memory_order_seq_cst);
  if (b.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&b.seq);
}

void RingSync::wake_everyone() const {
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) wake(r);
  }
}

// ----------------------------------------------------------------------------- calls

OpCall RingSync::begin(OpKind kind, DType dtype, uint64_t count, RedOp op, int root) {
  OpCall call;
  call.desc = OpDesc{++seq_, kind, dtype, count, op, root};
  call.lane = COLL;
  call.start = Clock::now();
  call.deadline = WaitPolicy::deadline_after(call.start, opts_.timeout);
  call.timeout_s = opts_.timeout.count() / 1000.0;
  throw_if_failed(call, "cannot run");
  mine()->recent[call.desc.seq % kRingHistory].store(call.desc);
  mine()->entered_seq.store(call.desc.seq, std::memory_order_release);
  check_agreement(call);
  return call;
}

// A peer that published another call for a sequence number this rank also called would
// walk a plan of another shape over the same step numbers. Looks at the last few calls,
// so a mismatch is found even when neither rank had to wait for the other.
void RingSync::check_agreement(const OpCall& call) const {
  const uint64_t seq = call.desc.seq;
  const uint64_t oldest = seq >= kRingHistory ? seq - kRingHistory + 1 : 1;
  for (uint64_t s = seq; s >= oldest && s > 0; --s) {
    OpDesc me;
    if (!mine()->recent[s % kRingHistory].load(s, &me)) continue;
    for (int r = 0; r < size_; ++r) {
      OpDesc theirs;
      if (r == rank_ || !of(r)->recent[s % kRingHistory].load(s, &theirs)) continue;
      if (!same_call(me, theirs)) {
        fail("pycomm: ranks disagree at seq " + std::to_string(s) + ": rank " +
             std::to_string(rank_) + " called " + describe(me) + " but rank " + std::to_string(r) +
             " called " + describe(theirs) + " (CUDA ring)");
      }
    }
  }
}

// What rank r called at `seq`, as far as its counters still tell.
std::string RingSync::call_of(int r, uint64_t seq) const {
  OpDesc d;
  if (of(r)->recent[seq % kRingHistory].load(seq, &d)) return describe(d);
  uint64_t at = of(r)->entered_seq.load(std::memory_order_acquire);
  if (at != 0 && of(r)->recent[at % kRingHistory].load(at, &d)) {
    return describe(d) + " at seq " + std::to_string(at);
  }
  return "nothing yet (it is at seq " + std::to_string(at) + ")";
}

// --------------------------------------------------------------------------- protocol

void RingSync::wait_posted(const OpCall& call, uint64_t step) {
  const RingRank* p = of(prev());
  wait(
      call, [&] { return p->posted.load(std::memory_order_acquire) > step; },
      Awaited{prev(), "post", step});
  check_tag(call, step);
}

// The predecessor cannot rewrite the slot before this rank has read it, so the tag of a
// posted step is stable: anything but this step of this call means the predecessor
// walks another plan (it called something else, or fewer or more ops).
void RingSync::check_tag(const OpCall& call, uint64_t step) const {
  const RingSlotTag& tag = of(prev())->window[step % opts_.slots];
  OpDesc theirs;
  bool ok = tag.step_plus_1.load(std::memory_order_acquire) == step + 1 &&
            tag.call.load(call.desc.seq, &theirs) && same_call(theirs, call.desc);
  if (ok) return;
  std::string what =
      load_any(tag.call, &theirs)
          ? describe(theirs) +
                (theirs.seq == call.desc.seq ? "" : " at seq " + std::to_string(theirs.seq))
          : call_of(prev(), call.desc.seq);
  fail("pycomm: ranks disagree at seq " + std::to_string(call.desc.seq) + ": rank " +
       std::to_string(rank_) + " called " + describe(call.desc) + " but rank " +
       std::to_string(prev()) + " called " + what +
       " (CUDA ring: seen in the tag of its window slot " + std::to_string(step % opts_.slots) +
       ", which should hold step " + std::to_string(step) + " of this call)");
}

void RingSync::wait_read(const OpCall& call, uint64_t step) {
  const RingRank* n = of(next());
  wait(
      call, [&] { return n->read_prev.load(std::memory_order_acquire) > step; },
      Awaited{next(), "read", step});
}

void RingSync::wrote(const OpCall& call, uint64_t step) {
  RingSlotTag& tag = mine()->window[step % opts_.slots];
  tag.step_plus_1.store(0, std::memory_order_relaxed);
  tag.call.store(call.desc);
  tag.step_plus_1.store(step + 1, std::memory_order_release);
}

int64_t RingSync::held(int slot) const {
  return static_cast<int64_t>(mine()->window[slot].step_plus_1.load(std::memory_order_relaxed)) - 1;
}

void RingSync::read(uint64_t step) {
  mine()->read_prev.store(step + 1, std::memory_order_release);
  wake(prev());
}

void RingSync::post(uint64_t step) {
  mine()->posted.store(step + 1, std::memory_order_release);
  wake(next());
}

// ------------------------------------------------------------------------------ waits

template <class Ready>
void RingSync::wait(const OpCall& call, Ready ready, const Awaited& what) {
  if (ready() || opts_.wait.poll(ready)) return;
  Bell& bell = mine()->bell;
  // Woken by its peer, run at once rather than behind the core's busy threads (wait_slice.h).
  ShortSlice asleep(opts_.wait.sleep_slice_us);
  for (;;) {
    const uint32_t seen = bell.seq.load(std::memory_order_seq_cst);
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const bool done = ready();
    if (!done) {
      try {
        check(call, what);
      } catch (...) {
        bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
        throw;
      }
      futex_wait(&bell.seq, seen, WaitPolicy::sleep_us(call.deadline));
    }
    bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (done || ready()) return;
  }
}

void RingSync::check(const OpCall& call, const Awaited& what) {
  throw_if_failed(call, "stopped");
  const auto now = Clock::now();
  if (now >= call.deadline) fail(timeout_message(call, what));
  if (now < next_scan_) return;
  next_scan_ = now + WaitPolicy::kCheckEvery;
  check_peers(call, what);
  check_agreement(call);
}

// Any rank gone fails the call: the ring passes through every rank.
void RingSync::check_peers(const OpCall& call, const Awaited& what) const {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    RingRankState st = state_of(r);
    std::string how;
    if (st == RingRankState::DRAINED || st == RingRankState::LEFT) {
      how = " left the group (destroyed it, having called fewer ops than rank " +
            std::to_string(rank_) + ")";
    } else if (st == RingRankState::JOINED && !liveness_.alive(r)) {
      how = " died (its process exited)";
    } else {
      continue;
    }
    fail("pycomm: " + where(call, rank_) + " failed in the CUDA ring: rank " + std::to_string(r) +
         how + " while rank " + std::to_string(rank_) + " waited for rank " +
         std::to_string(what.peer) + " to " + what.verb + " step " + std::to_string(what.step));
  }
}

std::string RingSync::timeout_message(const OpCall& call, const Awaited& what) const {
  std::string msg = "pycomm: " + where(call, rank_) + " timed out after " +
                    seconds(call.timeout_s) + " s in the CUDA ring waiting for rank " +
                    std::to_string(what.peer) + " to " + what.verb + " step " +
                    std::to_string(what.step);
  std::string behind;
  for (int r = 0; r < size_; ++r) {
    uint64_t at = of(r)->entered_seq.load(std::memory_order_acquire);
    if (at < call.desc.seq) {
      behind += (behind.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) +
                " is at seq " + std::to_string(at);
    }
  }
  if (!behind.empty())
    return msg + ": not every rank arrived at seq " + std::to_string(call.desc.seq) + " (" +
           behind + ")";
  return msg + ": every rank arrived at seq " + std::to_string(call.desc.seq) + "; rank " +
         std::to_string(what.peer) + " is slow or stuck waiting for another rank";
}

// ------------------------------------------------------------------------- the record

// The note is written in full before the one CAS that makes it the job's failure: a
// reader never sees a half-written reason, and a rank dying half way leaves no claim
// that nobody can complete.
void RingSync::abort(const std::string& why) const {
  if (!base_ || failed_by() >= 0) return;
  RingNote& note = mine()->note;
  uint32_t state = 0;
  if (note.state.compare_exchange_strong(state, 1, std::memory_order_acq_rel)) {
    std::snprintf(note.why, sizeof(note.why), "%s", why.c_str());
    note.state.store(2, std::memory_order_release);
  } else if (state == 1) {
    return;  // another thread of this rank is writing it, and will publish it
  }
  uint32_t none = 0;
  ring_header(base_)->failed_by.compare_exchange_strong(none, static_cast<uint32_t>(rank_) + 1,
                                                        std::memory_order_acq_rel);
  wake_everyone();
}

void RingSync::fail(const std::string& msg) const {
  abort(msg);
  throw CommError(msg);
}

int RingSync::failed_by() const {
  if (!base_) return -1;
  return static_cast<int>(ring_header(base_)->failed_by.load(std::memory_order_acquire)) - 1;
}

std::string RingSync::abort_message() const {
  int r = failed_by();
  if (r < 0 || r >= size_) return "";
  const RingNote& note = of(r)->note;
  return std::string(note.why, strnlen(note.why, sizeof(note.why)));
}

void RingSync::throw_if_failed(const OpCall& call, const char* doing) const {
  int r = failed_by();
  if (r < 0) return;
  throw CommError("pycomm: " + where(call, rank_) + " " + doing +
                  ": the job failed (recorded by rank " + std::to_string(r) +
                  "): " + abort_message());
}

// --------------------------------------------------------------------------- teardown

bool RingSync::peer_alive(int r) const {
  RingRankState st = state_of(r);
  if (st == RingRankState::DRAINED || st == RingRankState::LEFT) return false;
  return st == RingRankState::ABSENT || liveness_.alive(r);
}

bool RingSync::hurry() const {
  if (failed_by() >= 0) return true;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_ && state_of(r) == RingRankState::JOINED && !liveness_.alive(r)) return true;
  }
  return false;
}

void RingSync::drained() {
  drained_ = true;
  mine()->state.store(static_cast<uint32_t>(RingRankState::DRAINED), std::memory_order_release);
  wake_everyone();
}

bool RingSync::settle(const std::function<bool()>& done, Clock::time_point deadline) const {
  if (done() || opts_.wait.poll(done)) return true;
  constexpr auto kGrace = std::chrono::seconds(1);
  Bell& bell = mine()->bell;
  bool hurried = false;
  for (;;) {
    if (!hurried && hurry()) {
      hurried = true;
      deadline = std::min(deadline, Clock::now() + kGrace);
    }
    if (Clock::now() >= deadline) return false;
    // Peers ring on leaving or failing; device work rings nobody: a slice then.
    const uint32_t seen = bell.seq.load(std::memory_order_seq_cst);
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!done()) futex_wait(&bell.seq, seen, WaitPolicy::sleep_us(deadline));
    bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (done()) return true;
  }
}

// A peer that died has no device work left (its context went with it); one that left
// undrained may still be reading, so it never counts as drained.
bool RingSync::wait_drained(int peer, Clock::time_point deadline) const {
  auto is_drained = [&] {
    RingRankState st = state_of(peer);
    return st == RingRankState::DRAINED || (st == RingRankState::JOINED && !liveness_.alive(peer));
  };
  settle([&] { return is_drained() || state_of(peer) == RingRankState::LEFT; }, deadline);
  return is_drained();
}

}  // namespace pycomm
