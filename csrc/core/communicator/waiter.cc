#include "core/communicator/waiter.h"

#include <algorithm>
#include <cstdio>

#include "core/base/errors.h"

namespace pycomm {
namespace {

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

}  // namespace

int64_t Waiter::check_or_leave(const OpCall& op, const std::vector<int>& who, Bell* bell) {
  try {
    check(op, who);
  } catch (...) {
    bell->done_sleeping();
    throw;
  }
  return WaitPolicy::sleep_us(op.deadline);
}

void Waiter::throw_if_aborted(const OpCall& op) const {
  if (shared_.aborted()) {
    throw CommError("pycomm: " + where(op, shared_.rank()) +
                    " cannot run: the job already failed: " + shared_.abort_message());
  }
}

void Waiter::fail(const std::string& msg) const {
  shared_.set_abort(msg);
  throw CommError(msg);
}

void Waiter::check(const OpCall& op, const std::vector<int>& who) {
  throw_if_aborted(op);
  auto now = Clock::now();
  if (now >= op.deadline) fail(timeout_message(op, who));
  if (now < next_scan_) return;
  next_scan_ = now + WaitPolicy::kCheckEvery;
  for (int r : who) {
    std::string gone = shared_.peer_gone(r);
    if (!gone.empty()) fail("pycomm: " + where(op, shared_.rank()) + " failed: " + gone);
  }
  if (op.lane == COLL) check_agreement(op);
}

// A rank that entered the same sequence number with a different call would otherwise
// wait forever for a message that never comes (or read one of the wrong size).
void Waiter::check_agreement(const OpCall& op) const {
  uint64_t seq = op.desc.seq;
  for (int r = 0; r < shared_.world(); ++r) {
    if (r == shared_.rank()) continue;
    OpDesc theirs;
    if (!shared_.control(r)->recent[seq % 4].load(seq, &theirs)) continue;
    if (!publishable(theirs)) fail(unpublishable(r, "descriptor of its call", theirs));
    if (!same_call(theirs, op.desc)) {
      fail("pycomm: ranks disagree at seq " + std::to_string(seq) + ": rank " +
           std::to_string(shared_.rank()) + " called " + describe(op.desc) + " but rank " +
           std::to_string(r) + " called " + describe(theirs));
    }
  }
}

std::string Waiter::timeout_message(const OpCall& op, const std::vector<int>& who) const {
  char secs[32];
  std::snprintf(secs, sizeof(secs), "%.1f", op.timeout_s);
  std::string msg = "pycomm: " + where(op, shared_.rank()) + " timed out after " + secs + " s";
  if (op.lane != COLL) return msg + " waiting for rank(s) " + rank_list(who);
  std::vector<int> missing;
  std::string at;
  for (int r = 0; r < shared_.world(); ++r) {
    uint64_t entered = shared_.control(r)->entered_seq.load(std::memory_order_acquire);
    if (entered < op.desc.seq) {
      missing.push_back(r);
      at += (at.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " is at seq " +
            std::to_string(entered);
    }
  }
  if (missing.empty()) return msg + " waiting for rank(s) " + rank_list(who);
  return msg + ": rank(s) " + rank_list(missing) + " did not arrive at seq " +
         std::to_string(op.desc.seq) + " (" + at + ")";
}

}  // namespace pycomm
