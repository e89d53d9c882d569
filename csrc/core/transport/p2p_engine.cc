#include "core/transport/p2p_engine.h"

#include <algorithm>
#include <cstring>

#include "core/runtime/errors.h"

namespace pycomm {
namespace {

constexpr auto kScanEvery = std::chrono::milliseconds(20);
constexpr int64_t kBusySleepUs = 20000;
constexpr int64_t kIdleSleepUs = 200000;

std::string what(const P2PRequest& r, int me) {
  OpDesc d{0, OpKind::SEND, r.dtype, r.count, RedOp::NONE, r.tag};
  std::string s = describe(d);  // "send float32[100] tag 0"
  if (!r.is_send) s.replace(0, 4, "recv");
  return s + (r.is_send ? " to rank " : " from rank ") + std::to_string(r.peer) + " on rank " +
         std::to_string(me);
}

}  // namespace

P2PEngine::P2PEngine(const Shared& shared, const Logger& log, std::chrono::milliseconds timeout)
    : shared_(shared),
      log_(log),
      timeout_ms_(timeout.count()),
      waiter_(shared, P2P, WaitPolicy()),
      transport_(shared, P2P, waiter_),
      sends_(shared.world()),
      recvs_(shared.world()),
      sent_msgs_(shared.world(), 0),
      recv_msgs_(shared.world(), 0),
      thread_([this] { loop(); }) {}

P2PEngine::~P2PEngine() {
  stop_.store(true);
  shared_.ring(shared_.rank(), P2P);
  if (thread_.joinable()) thread_.join();
  take_inbox();
  fail_all("pycomm: send/recv cancelled: the process group was shut down");
}

void P2PEngine::submit(P2PRequest req) {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    inbox_.push_back(std::move(req));
  }
  shared_.ring(shared_.rank(), P2P);
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
    int peer = req.peer;
    uint64_t index = req.is_send ? ++sent_msgs_[peer] : ++recv_msgs_[peer];
    a.call.desc = OpDesc{index, OpKind::SEND, req.dtype, req.count, RedOp::NONE, req.tag};
    a.call.lane = P2P;
    a.call.start = Clock::now();
    a.call.timeout_s = timeout_ms_.load() / 1000.0;
    a.call.deadline = a.call.start + std::chrono::milliseconds(timeout_ms_.load());
    a.req = std::move(req);
    log_.log(LogLevel::TRACE,
             what(a.req, shared_.rank()) + " queued (message " + std::to_string(index) + ")");
    (a.req.is_send ? sends_ : recvs_)[peer].push_back(std::move(a));
  }
}

void P2PEngine::complete(std::deque<Active>& q, std::exception_ptr err) {
  Active a = std::move(q.front());
  q.pop_front();
  a.req.done(err);
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
  if (a.moved == a.bytes && a.chunks > 0) complete(q, nullptr);
  return progressed;
}

// Copies out every chunk of the oldest recv from `peer` that has arrived.
bool P2PEngine::step_recv(int peer) {
  auto& q = recvs_[peer];
  if (q.empty()) return false;
  Active& a = q.front();
  bool progressed = false;
  const SlotHeader* h;
  while ((a.moved < a.bytes || a.chunks == 0) && (h = transport_.peek(peer)) != nullptr) {
    size_t n = std::min(transport_.chunk_bytes(), a.bytes - a.moved);
    const OpDesc& d = h->desc;
    if (d.seq != a.call.desc.seq || !same_call(d, a.call.desc) || h->offset != a.moved ||
        h->bytes != n) {
      mismatch(a, *h);
    }
    std::memcpy(static_cast<char*>(a.req.data) + a.moved, h + 1, n);
    transport_.release(peer);
    a.moved += n;
    ++a.chunks;
    progressed = true;
  }
  if (a.moved == a.bytes && a.chunks > 0) complete(q, nullptr);
  return progressed;
}

void P2PEngine::mismatch(const Active& a, const SlotHeader& h) {
  std::string msg = "pycomm: " + what(a.req, shared_.rank()) + " does not match what rank " +
                    std::to_string(a.req.peer) + " sent: " + describe(h.desc) + " (message " +
                    std::to_string(h.desc.seq) + " between them)";
  throw CommError(msg);
}

bool P2PEngine::pending() const {
  for (size_t p = 0; p < sends_.size(); ++p)
    if (!sends_[p].empty() || !recvs_[p].empty()) return true;
  return false;
}

void P2PEngine::fail_all(const std::string& msg) {
  for (auto* queues : {&sends_, &recvs_}) {
    for (auto& q : *queues) {
      while (!q.empty()) complete(q, std::make_exception_ptr(CommError(msg)));
    }
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
  if (scan) next_scan_ = now + kScanEvery;
  for (auto* queues : {&sends_, &recvs_}) {
    for (auto& q : *queues) {
      if (q.empty()) continue;
      const Active& a = q.front();
      std::string msg;
      if (now >= a.call.deadline) {
        char secs[32];
        std::snprintf(secs, sizeof(secs), "%.1f", a.call.timeout_s);
        msg = "pycomm: " + what(a.req, shared_.rank()) + " timed out after " + secs + " s";
      } else if (scan) {
        std::string gone = shared_.peer_gone(a.req.peer);
        if (!gone.empty()) msg = "pycomm: " + what(a.req, shared_.rank()) + " failed: " + gone;
      }
      if (!msg.empty()) {
        shared_.set_abort(msg);
        fail_all(msg);
        return;
      }
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
          (!recvs_[p].empty() && transport_.peek(p) != nullptr);
  }
  return any || stop_.load();
}

void P2PEngine::loop() {
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
    uint32_t seen = bell.seq.load(std::memory_order_seq_cst);
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!idle_check()) {
      check_health();
      futex_wait(&bell.seq, seen, pending() ? kBusySleepUs : kIdleSleepUs);
    }
    bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace pycomm
