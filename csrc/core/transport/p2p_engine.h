// Point-to-point send/recv on their own lane and thread. Requests are state machines
// advanced a slot at a time, so any number of isend/irecv to any peers can be in flight
// at once without deadlock (two ranks sending large messages to each other, then
// receiving, both complete).
//
// Matching follows MPI and gloo: a message goes to the oldest posted recv from its
// sender (or from any source) with its tag. Messages between two ranks travel in the
// order sent, so a message that arrives before its recv is posted, while a recv for a
// later one waits, is copied out to this process (a "stashed" message) to reach the
// later one; a message nobody has asked for yet stays in the channel.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/base/log.h"
#include "core/communicator/waiter.h"
#include "core/transport/shared_state.h"
#include "core/transport/transport.h"

namespace pycomm {

constexpr int kAnySource = -1;

struct P2PRequest {
  bool is_send = true;
  int peer = 0;  // kAnySource: a recv from whichever rank sends first with this tag
  int tag = 0;
  DType dtype = DType::F32;
  size_t count = 0;
  void* data = nullptr;
  // Called on the engine thread with null on success or the failure, and the rank the
  // data came from (recv) or went to (send).
  std::function<void(std::exception_ptr, int peer)> done;
};

class P2PEngine {
 public:
  // `wait_slice_us`: the time slice the engine's thread keeps (wait_slice.h; 0: the
  // scheduler's): it only ever wakes for peers and posts, so it should run when woken.
  P2PEngine(const Shared& shared, const Logger& log, std::chrono::milliseconds timeout,
            uint32_t wait_slice_us = 0);
  ~P2PEngine();
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  void submit(P2PRequest req);  // thread-safe; returns at once
  // Joins the engine's thread and fails what is posted; a later submit() fails at once
  // (on the caller's thread). Idempotent; the destructor calls it.
  void stop();
  void set_timeout(std::chrono::milliseconds t) { timeout_ms_ = t.count(); }

 private:
  struct Active {
    P2PRequest req;
    OpCall call;
    size_t bytes = 0;
    size_t moved = 0;  // bytes copied so far
    size_t chunks = 0;
  };
  // A message that arrived before its recv: its bytes, kept here until one is posted.
  struct Stash {
    int peer = 0;
    int tag = 0;
    size_t bytes = 0;
    std::vector<char> data;
    bool complete = false;
    bool discard = false;             // a recv of another size consumed it
    std::unique_ptr<Active> claimed;  // the recv it goes to once complete
  };
  // The message being copied from one peer, into a recv or a stash.
  struct Incoming {
    OpDesc desc;  // as its first chunk said
    size_t bytes = 0, moved = 0;
    std::unique_ptr<Active> recv;  // exactly one of recv and stash
    Stash* stash = nullptr;
    std::exception_ptr refused;  // the recv's sizes disagree: its bytes are dropped
  };

  void loop();
  void take_inbox();
  void post_recv(Active a);
  void send_to_self(Active a);
  bool step_send(int peer);
  bool step_recv(int peer);
  bool start_message(int peer, const SlotHeader& h);
  void copy_chunk(int peer, const SlotHeader& h);
  void finish_message(int peer);
  std::unique_ptr<Active> take_posted(int peer, int tag);
  bool wants_from(int peer) const;
  bool pending() const;
  bool idle_check();  // true if the loop has something to do (so it must not sleep)
  void check_health();
  void fail_all(const std::string& msg);
  void finish(Active& a, std::exception_ptr err, int peer);
  std::exception_ptr size_mismatch(const Active& a, int peer, size_t bytes) const;
  [[noreturn]] void protocol_error(int peer, const SlotHeader& h, const std::string& why);
  std::string what(const P2PRequest& r) const;

  const Shared& shared_;
  const Logger& log_;
  std::atomic<int64_t> timeout_ms_;
  uint32_t wait_slice_us_;
  Waiter waiter_;
  Transport transport_;
  std::vector<std::deque<Active>> sends_;
  std::list<Active> posted_;        // recvs not yet matched, in posting order
  std::list<Stash> stashed_;        // in arrival order
  std::vector<Incoming> incoming_;  // per peer; desc.seq == 0 when none
  std::vector<uint64_t> sent_msgs_, received_msgs_;
  std::mutex inbox_mu_;
  std::vector<P2PRequest> inbox_;
  std::atomic<bool> stop_{false};
  bool closed_ = false;  // under inbox_mu_: stop() has taken the inbox for the last time
  Clock::time_point next_scan_{};
  std::thread thread_;
};

}  // namespace pycomm
