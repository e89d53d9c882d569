#include "core/transport/p2p_engine.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "core/base/errors.h"
#include "core/base/wait_slice.h"

namespace pycomm {

namespace {
const char* const kShutDown = "pycomm: send/recv cancelled: the process group was shut down";
}  // namespace
namespace {

// An idle engine (nothing posted) looks at its inbox this often even unwoken.
constexpr int64_t kIdleSleepUs = 200000;

std::string rank_name(int peer) {
  return peer == kAnySource ? "any rank" : "rank " + std::to_string(peer);
}

}  // namespace

P2PEngine::P2PEngine(const Shared& shared, const Logger& log, std::chrono::milliseconds timeout,
                     uint32_t wait_slice_us)
    : shared_(shared),
      log_(log),
      timeout_ms_(timeout.count()),
      wait_slice_us_(wait_slice_us),
      waiter_(shared, P2P, WaitPolicy()),
      transport_(shared, P2P, waiter_),
      sends_(shared.world()),
      incoming_(shared.world()),
      sent_msgs_(shared.world(), 0),
      received_msgs_(shared.world(), 0),
      thread_([this] { loop(); }) {}

P2PEngine::~P2PEngine() { stop(); }

void P2PEngine::stop() {
  stop_.store(true);
  shared_.ring(shared_.rank(), P2P);
  if (thread_.joinable()) thread_.join();
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    closed_ = true;  // what submit() hands over from here on fails at once
  }
  take_inbox();
  fail_all(kShutDown);
}

std::string P2PEngine::what(const P2PRequest& r) const {
  OpDesc d{0, OpKind::SEND, r.dtype, r.count, RedOp::NONE, r.tag};
  std::string s = describe(d);  // "send float32[100] tag 0"
  if (!r.is_send) s.replace(0, 4, "recv");
  return s + (r.is_send ? " to " : " from ") + rank_name(r.peer) + " on rank " +
         std::to_string(shared_.rank());
}

void P2PEngine::submit(P2PRequest req) {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    if (!closed_) {
      inbox_.push_back(std::move(req));
      shared_.ring(shared_.rank(), P2P);
      return;
    }
  }
  req.done(std::make_exception_ptr(CommError(kShutDown)), req.peer);  // after stop()
}

void P2PEngine::take_inbox() {
  std::vector<P2PRequest> fresh;
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    fresh.swap(inbox_);
  }
  for (auto& req : fresh) {
    Active a;
    a.bytes = req.count * dtype_size(req.dtype);
    a.call.desc = OpDesc{0, OpKind::SEND, req.dtype, req.count, RedOp::NONE, req.tag};
    a.call.lane = P2P;
    a.call.start = Clock::now();
    a.call.timeout_s = timeout_ms_.load() / 1000.0;
    a.call.deadline =
        WaitPolicy::deadline_after(a.call.start, std::chrono::milliseconds(timeout_ms_.load()));
    a.req = std::move(req);
    if (log_.enabled(LogLevel::TRACE, Subsys::P2P))
      log_.log(LogLevel::TRACE, Subsys::P2P, what(a.req) + " posted");
    if (a.req.is_send && a.req.peer == shared_.rank()) {
      send_to_self(std::move(a));
    } else if (a.req.is_send) {
      int peer = a.req.peer;
      a.call.desc.seq = ++sent_msgs_[peer];  // the message's number between the two
      sends_[peer].push_back(std::move(a));
    } else {
      post_recv(std::move(a));
    }
  }
}

std::exception_ptr P2PEngine::size_mismatch(const Active& a, int peer, size_t bytes) const {
  return std::make_exception_ptr(CommError(
      "pycomm: " + what(a.req) + " (" + std::to_string(a.bytes) + " bytes) does not match what " +
      "rank " + std::to_string(peer) + " sent with tag " + std::to_string(a.req.tag) + " (" +
      std::to_string(bytes) + " bytes)"));
}

void P2PEngine::finish(Active& a, std::exception_ptr err, int peer) {
  if (log_.enabled(LogLevel::TRACE, Subsys::P2P))
    log_.log(LogLevel::TRACE, Subsys::P2P, what(a.req) + (err ? " failed" : " done"));
  a.req.done(err, peer);
}

// A recv takes the oldest stashed message it matches, else waits in posting order.
void P2PEngine::post_recv(Active a) {
  for (auto it = stashed_.begin(); it != stashed_.end(); ++it) {
    bool from = a.req.peer == kAnySource || a.req.peer == it->peer;
    if (it->claimed || it->discard || it->tag != a.req.tag || !from) continue;
    if (it->bytes != a.bytes) {
      finish(a, size_mismatch(a, it->peer, it->bytes), it->peer);
      if (it->complete)
        stashed_.erase(it);
      else
        it->discard = true;  // consumed, as MPI does with a truncated message
    } else if (it->complete) {
      std::memcpy(a.req.data, it->data.data(), a.bytes);
      finish(a, nullptr, it->peer);
      stashed_.erase(it);
    } else {
      it->claimed = std::make_unique<Active>(std::move(a));
    }
    return;
  }
  posted_.push_back(std::move(a));
}

// torch allows a rank to send to itself: the message goes straight to a matching recv,
// or waits, copied, as a stashed message from this rank; the send is done either way.
void P2PEngine::send_to_self(Active a) {
  const int me = shared_.rank();
  if (auto recv = take_posted(me, a.req.tag)) {
    if (recv->bytes != a.bytes) {
      finish(*recv, size_mismatch(*recv, me, a.bytes), me);
    } else {
      std::memcpy(recv->req.data, a.req.data, a.bytes);
      finish(*recv, nullptr, me);
    }
  } else {
    Stash& s = stashed_.emplace_back(Stash{me, a.req.tag, a.bytes});
    s.data.assign(static_cast<char*>(a.req.data), static_cast<char*>(a.req.data) + a.bytes);
    s.complete = true;
  }
  finish(a, nullptr, me);
}

std::unique_ptr<P2PEngine::Active> P2PEngine::take_posted(int peer, int tag) {
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (it->req.tag == tag && (it->req.peer == peer || it->req.peer == kAnySource)) {
      auto a = std::make_unique<Active>(std::move(*it));
      posted_.erase(it);
      return a;
    }
  }
  return nullptr;
}

bool P2PEngine::wants_from(int peer) const {
  for (const auto& a : posted_)
    if (a.req.peer == peer || a.req.peer == kAnySource) return true;
  return false;
}

// Copies as many chunks of the oldest send to `peer` as there are free slots.
bool P2PEngine::step_send(int peer) {
  auto& q = sends_[peer];
  if (q.empty()) return false;
  Active& a = q.front();
  bool progressed = false;
  while ((a.moved < a.bytes || a.chunks == 0) && transport_.can_acquire(peer)) {
    size_t n = std::min(transport_.chunk_bytes(), a.bytes - a.moved);
    std::memcpy(transport_.slot_payload_for_send(peer), static_cast<char*>(a.req.data) + a.moved,
                n);
    transport_.publish(peer, a.call, a.moved, n, a.bytes);
    a.moved += n;
    ++a.chunks;
    progressed = true;
  }
  if (a.moved == a.bytes && a.chunks > 0) {
    Active done = std::move(q.front());
    q.pop_front();
    finish(done, nullptr, peer);
  }
  return progressed;
}

// Copies out every chunk from `peer` that has arrived and that someone has asked for.
bool P2PEngine::step_recv(int peer) {
  bool progressed = false;
  const SlotHeader* h;
  while ((h = transport_.peek(peer)) != nullptr) {
    if (incoming_[peer].desc.seq == 0 && !start_message(peer, *h)) break;
    copy_chunk(peer, *h);
    progressed = true;
  }
  return progressed;
}

// The first chunk of a message: to the oldest matching recv, else to a stash if some
// recv from this peer waits (for a later message), else it stays in the channel.
bool P2PEngine::start_message(int peer, const SlotHeader& h) {
  const OpDesc& d = h.desc;
  uint64_t bytes = 0;
  if (d.kind != OpKind::SEND || d.seq != received_msgs_[peer] + 1 || h.offset != 0 ||
      static_cast<uint32_t>(d.dtype) > static_cast<uint32_t>(DType::BOOL) ||
      __builtin_mul_overflow(d.count, dtype_size(d.dtype), &bytes) || bytes != h.msg_bytes) {
    protocol_error(
        peer, h,
        "it is not the start of message " + std::to_string(received_msgs_[peer] + 1) + " from it");
  }
  Incoming& in = incoming_[peer];
  if (auto recv = take_posted(peer, d.root)) {
    if (recv->bytes != h.msg_bytes) in.refused = size_mismatch(*recv, peer, h.msg_bytes);
    in.recv = std::move(recv);
  } else if (wants_from(peer)) {
    stashed_.push_back(Stash{peer, d.root, h.msg_bytes});
    try {
      stashed_.back().data.resize(h.msg_bytes);
    } catch (const std::bad_alloc&) {
      stashed_.pop_back();
      protocol_error(peer, h,
                     "this process cannot hold its " + std::to_string(h.msg_bytes) +
                         " bytes until a recv with its tag is posted");
    }
    in.stash = &stashed_.back();
  } else {
    return false;
  }
  in.desc = d;
  in.bytes = h.msg_bytes;
  in.moved = 0;
  ++received_msgs_[peer];
  return true;
}

void P2PEngine::copy_chunk(int peer, const SlotHeader& h) {
  Incoming& in = incoming_[peer];
  size_t n = std::min(transport_.chunk_bytes(), in.bytes - in.moved);
  if (h.desc.seq != in.desc.seq || !same_call(h.desc, in.desc) || h.offset != in.moved ||
      h.bytes != n || h.msg_bytes != in.bytes) {
    protocol_error(peer, h,
                   "expected " + std::to_string(n) + " bytes at " + std::to_string(in.moved) +
                       " of message " + std::to_string(in.desc.seq));
  }
  char* dst = nullptr;
  if (in.recv && !in.refused) dst = static_cast<char*>(in.recv->req.data);
  if (in.stash && !in.stash->discard) dst = in.stash->data.data();
  if (dst != nullptr) std::memcpy(dst + in.moved, transport_.payload(peer, h), n);
  transport_.release(peer);
  in.moved += n;
  if (in.moved == in.bytes) finish_message(peer);  // (a 0-byte message is one chunk)
}

void P2PEngine::finish_message(int peer) {
  Incoming in = std::move(incoming_[peer]);
  incoming_[peer] = Incoming{};
  if (in.recv) return finish(*in.recv, in.refused, peer);
  Stash* s = in.stash;
  s->complete = true;
  if (!s->claimed && !s->discard) return;  // waits for its recv
  if (s->claimed) {
    std::memcpy(s->claimed->req.data, s->data.data(), s->bytes);
    finish(*s->claimed, nullptr, peer);
  }
  stashed_.remove_if([s](const Stash& x) { return &x == s; });
}

void P2PEngine::protocol_error(int peer, const SlotHeader& h, const std::string& why) {
  if (h.desc.kind != OpKind::SEND || !publishable(h.desc) || h.offset > h.msg_bytes) {
    throw CommError(unpublishable(peer, "send/recv message header", h.desc) + " (chunk of " +
                    std::to_string(h.bytes) + " bytes at " + std::to_string(h.offset) + " of " +
                    std::to_string(h.msg_bytes) + ")");
  }
  throw CommError("pycomm: send/recv on rank " + std::to_string(shared_.rank()) + ": rank " +
                  std::to_string(peer) + " sent " + describe(h.desc) + " (message " +
                  std::to_string(h.desc.seq) + ", " + std::to_string(h.bytes) + " bytes at " +
                  std::to_string(h.offset) + " of " + std::to_string(h.msg_bytes) + ") but " + why);
}

bool P2PEngine::pending() const {
  for (size_t p = 0; p < sends_.size(); ++p)
    if (!sends_[p].empty() || incoming_[p].desc.seq != 0) return true;
  for (const auto& s : stashed_)
    if (s.claimed) return true;
  return !posted_.empty();
}

void P2PEngine::fail_all(const std::string& msg) {
  auto err = std::make_exception_ptr(CommError(msg));
  for (size_t p = 0; p < sends_.size(); ++p) {
    while (!sends_[p].empty()) {
      Active a = std::move(sends_[p].front());
      sends_[p].pop_front();
      finish(a, err, static_cast<int>(p));
    }
    Incoming in = std::move(incoming_[p]);
    incoming_[p] = Incoming{};
    if (in.recv) finish(*in.recv, err, static_cast<int>(p));
  }
  for (auto& s : stashed_)
    if (s.claimed) finish(*s.claimed, err, s.peer);
  stashed_.clear();
  while (!posted_.empty()) {
    Active a = std::move(posted_.front());
    posted_.pop_front();
    finish(a, err, a.req.peer);
  }
}

// The slow path: a failure elsewhere in the job, a deadline passed, a dead peer.
void P2PEngine::check_health() {
  if (shared_.aborted()) {
    fail_all("pycomm: send/recv cannot go on: the job failed: " + shared_.abort_message());
    return;
  }
  auto now = Clock::now();
  bool scan = now >= next_scan_;
  if (scan) next_scan_ = now + WaitPolicy::kCheckEvery;
  std::vector<const Active*> waiting;
  for (const auto& q : sends_)
    if (!q.empty()) waiting.push_back(&q.front());
  for (const auto& a : posted_) waiting.push_back(&a);
  for (const auto& in : incoming_)
    if (in.recv) waiting.push_back(in.recv.get());
  for (const auto& s : stashed_)
    if (s.claimed) waiting.push_back(s.claimed.get());
  for (const Active* a : waiting) {
    std::string msg;
    if (now >= a->call.deadline) {
      char secs[32];
      std::snprintf(secs, sizeof(secs), "%.1f", a->call.timeout_s);
      msg = "pycomm: " + what(a->req) + " timed out after " + secs + " s";
    }
    for (int r = 0; scan && msg.empty() && r < shared_.world(); ++r) {
      if (r == shared_.rank() || (a->req.peer != kAnySource && a->req.peer != r)) continue;
      std::string gone = shared_.peer_gone(r);
      if (!gone.empty()) msg = "pycomm: " + what(a->req) + " failed: " + gone;
    }
    if (!msg.empty()) {
      shared_.set_abort(msg);
      fail_all(msg);
      return;
    }
  }
}

bool P2PEngine::idle_check() {
  bool any = false;
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    any = !inbox_.empty();
  }
  for (int p = 0; p < shared_.world() && !any; ++p) {
    if (p == shared_.rank()) continue;
    any = (!sends_[p].empty() && transport_.can_acquire(p)) ||
          (transport_.peek(p) != nullptr && (incoming_[p].desc.seq != 0 || wants_from(p)));
  }
  return any || stop_.load();
}

void P2PEngine::loop() {
  shorten_slice_for_wait(wait_slice_us_);  // for the thread's life: it is the engine's
  Bell& bell = shared_.bell(shared_.rank(), P2P);
  while (!stop_.load()) {
    take_inbox();
    bool progressed = false;
    try {
      for (int p = 0; p < shared_.world(); ++p) {
        if (p == shared_.rank()) continue;
        progressed |= step_send(p);
        progressed |= step_recv(p);
      }
    } catch (const CommError& e) {
      shared_.set_abort(e.what());
      fail_all(e.what());
      continue;
    }
    if (progressed) continue;
    uint32_t seen = bell.prepare_sleep();
    if (!idle_check()) {
      check_health();
      const int64_t busy_us =
          std::chrono::duration_cast<std::chrono::microseconds>(WaitPolicy::kCheckEvery).count();
      futex_wait(&bell.seq, seen, pending() ? busy_us : kIdleSleepUs);
    }
    bell.done_sleeping();
  }
}

}  // namespace pycomm
