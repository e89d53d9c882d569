// One thread that runs submitted tasks in order: collectives must run in the same order
// on every rank, and off the caller's thread so async ops return at once.
//
// A task may start another (an op issued from a future callback, which runs on the
// thread that completed the op, as with gloo): that task runs at once, nested, on the
// same thread. Every rank's callbacks run at the same point of the group's order, so the
// nested ops are ordered alike everywhere, and a callback that waits for the op it
// issued (torch's PowerSGD hook) cannot deadlock the thread that must run it. A
// callback that waits for an op queued *behind* its own can never be served; the
// worker's stall watch cancels such queued tasks after `stall_after` with an error
// that says so, instead of hanging forever.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pycomm {

class Worker {
 public:
  // Called instead of a task that will never run, with the reason.
  using Cancel = std::function<void(const std::string& why)>;

  explicit Worker(std::chrono::milliseconds stall_after = std::chrono::minutes(30));
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Tasks handle their own exceptions; one that escapes would end the process.
  void submit(std::function<void()> task, Cancel cancel = {});
  // Runs `task` on the calling thread, and returns true, if nothing is queued or running
  // (so order is kept), or if the calling thread is running a task of this worker (a
  // nested task); false means the caller should submit() it instead. Synchronous ops
  // take this path: no hand-off to the worker and back (two thread wake-ups).
  bool run_inline(const std::function<void()>& task);
  // Whether the calling thread is running one of this worker's tasks right now.
  bool on_worker_thread() const { return current() == this; }
  // The worker whose task runs on the calling thread, or null (only compared: a Work
  // that outlived its worker may ask).
  static const Worker* current();
  // From a task: runs queued tasks here, in order, until done() holds or none is left
  // (a task that waits for a later one must run it itself: Work::wait from a callback).
  void run_queued_until(const std::function<bool()>& done);
  void set_stall_after(std::chrono::milliseconds t);
  // Runs what is queued, then joins. Idempotent.
  void stop();

  // The stall watch's check: when the running task has run longer than stall_after,
  // takes every queued task out and returns their cancellations (to be called by the
  // watch once it holds no lock: they complete Works, which runs user callbacks).
  std::vector<std::function<void()>> take_stalled(std::chrono::steady_clock::time_point now);

 private:
  struct Entry {
    std::function<void()> run;
    Cancel cancel;
  };
  void loop();
  void run_here(const std::function<void()>& task);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> tasks_;
  bool stopping_ = false;
  bool busy_ = false;  // a task is running (on the worker or inline)
  std::chrono::steady_clock::time_point running_since_{};
  std::chrono::milliseconds stall_after_;
  std::thread thread_;
};

}  // namespace pycomm
