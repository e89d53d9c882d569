// One thread that runs submitted tasks in order: collectives must run in the same order
// on every rank, and off the caller's thread so async ops return at once.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace pycomm {

class Worker {
 public:
  Worker();
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Tasks handle their own exceptions; one that escapes would end the process.
  void submit(std::function<void()> task);
  // Runs `task` on the calling thread if nothing is queued or running (so order is
  // kept), and returns true; false means the caller should submit() it instead.
  // Synchronous ops take this path: no hand-off to the worker and back, which costs
  // two thread wake-ups (tens of microseconds) per op.
  bool run_inline(const std::function<void()>& task);
  // Runs what is queued, then joins. Idempotent.
  void stop();

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  bool busy_ = false;  // a task is running (on the worker or inline)
  std::thread thread_;
};

}  // namespace pycomm
