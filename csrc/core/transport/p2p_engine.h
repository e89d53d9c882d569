// Point-to-point send/recv on their own lane and thread. Requests are state machines
// advanced a slot at a time, so any number of isend/irecv to any peers can be in flight
// at once without deadlock (two ranks sending large messages to each other, then
// receiving, both complete). Messages between two ranks arrive in the order sent.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/runtime/log.h"
#include "core/runtime/waiter.h"
#include "core/transport/shared_state.h"
#include "core/transport/transport.h"

namespace pycomm {

struct P2PRequest {
  bool is_send = true;
  int peer = 0;
  int tag = 0;
  DType dtype = DType::F32;
  size_t count = 0;
  void* data = nullptr;
  // Called on the engine thread with null on success or the failure.
  std::function<void(std::exception_ptr)> done;
};

class P2PEngine {
 public:
  P2PEngine(const Shared& shared, const Logger& log, std::chrono::milliseconds timeout);
  ~P2PEngine();
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  void submit(P2PRequest req);  // thread-safe; returns at once
  void set_timeout(std::chrono::milliseconds t) { timeout_ms_ = t.count(); }

 private:
  struct Active {
    P2PRequest req;
    OpCall call;
    size_t bytes = 0;
    size_t moved = 0;  // bytes copied so far
    size_t chunks = 0;
  };

  void loop();
  void take_inbox();
  bool step_send(int peer);
  bool step_recv(int peer);
  bool pending() const;
  bool idle_check();  // true if the loop has something to do (so it must not sleep)
  void check_health();
  void fail_all(const std::string& msg);
  void complete(std::deque<Active>& q, std::exception_ptr err);
  [[noreturn]] void mismatch(const Active& a, const SlotHeader& h);

  const Shared& shared_;
  const Logger& log_;
  std::atomic<int64_t> timeout_ms_;
  Waiter waiter_;
  Transport transport_;
  std::vector<std::deque<Active>> sends_, recvs_;
  std::vector<uint64_t> sent_msgs_, recv_msgs_;
  std::mutex inbox_mu_;
  std::vector<P2PRequest> inbox_;
  std::atomic<bool> stop_{false};
  Clock::time_point next_scan_{};
  std::thread thread_;
};

}  // namespace pycomm
