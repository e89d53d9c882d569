// One thread that runs submitted tasks in order: collectives must run in the same order
// on every rank, and off the caller's thread so async ops return at once.
//
// A task may start another (an op issued from a future callback, which runs on the
// thread that completed the op, as with gloo): that task runs at once, nested, on the
// same thread. Every rank's callbacks run at the same point of the group's order, so the
// nested ops are ordered alike everywhere, and a callback that waits for the op it
// issued (torch's PowerSGD hook) cannot deadlock the thread that must run it.
//
// A task that holds the thread longer than `stall_after` (the group's timeout) without
// any collective finishing, while ops wait behind it, is a stall: a callback that waits
// on the future of an op queued behind its own can never be served, and one that is
// only slow keeps every op queued behind it past its timeout. The stall watch then
// fails the *group* (on_stall: the failure record every rank reads, so no rank pairs an
// op with one another rank cancelled), and cancels the queued tasks with that error.
// A long task that makes progress (a coalesced block, a composed islands op, nested ops
// of a callback: each finished collective advances the progress counter) is not a stall.
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
  // Fails the group on every rank over `why` and returns the group's failure message
  // (the queued tasks are cancelled with it). Called once per stall, from the watch's
  // thread, holding no lock of the worker.
  using OnStall = std::function<std::string(const std::string& why)>;
  // A counter that grows whenever a collective of the group finishes (its sequence
  // number): a running task that moves it is making progress.
  using Progress = std::function<uint64_t()>;

  explicit Worker(std::chrono::milliseconds stall_after = std::chrono::minutes(30));
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // What a stall does and how progress is seen; without them a stall only cancels
  // the queued tasks (a worker of no group). Set before the first task.
  void watch_stalls(OnStall on_stall, Progress progress);

  // Tasks handle their own exceptions; one that escapes would end the process. After
  // stop(), a task is not queued: `cancel` gets "shut down" at once (or, with no
  // cancel, the task runs here, on the caller's thread: a completion must not be lost).
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
  // Called in a forked child (see fork_guard.h): the stall watch starts afresh.
  static void after_fork_in_child();
  // At interpreter exit (pycomm's atexit hook, the GIL released): waits until every
  // worker of the process has finished what it runs and what is queued, each for its
  // group's timeout and `cap` at most. A task that completes an op runs the op's
  // future callbacks, which may be Python: one still running when the interpreter
  // finalizes aborts the process ("must be called with the GIL held").
  static void wait_all_idle(std::chrono::milliseconds cap);
  bool idle();
  // From a task: runs queued tasks here, in order, until done() holds or none is left
  // (a task that waits for a later one must run it itself: Work::wait from a callback).
  void run_queued_until(const std::function<bool()>& done);
  void set_stall_after(std::chrono::milliseconds t);
  // Runs what is queued, then joins. Idempotent.
  void stop();

  // The stall watch's check: when the running task has held the thread longer than
  // stall_after without progress while tasks are queued, takes them out and returns
  // what to run once the watch holds no lock: the group's failure, then their
  // cancellations (they complete Works, which runs user callbacks).
  std::vector<std::function<void()>> take_stalled(std::chrono::steady_clock::time_point now);

 private:
  struct Entry {
    std::function<void()> run;
    Cancel cancel;
  };
  void loop();
  void run_here(const std::function<void()>& task);
  void started_locked();  // a task takes the thread (mu_ held)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> tasks_;
  bool stopping_ = false;
  bool busy_ = false;  // a task is running (on the worker or inline)
  // The last time the running task was seen to start or make progress.
  std::chrono::steady_clock::time_point running_since_{};
  uint64_t progress_seen_ = 0;  // the progress counter at running_since_
  std::chrono::milliseconds stall_after_;
  OnStall on_stall_;
  Progress progress_;
  bool joined_ = false;  // the thread has taken its last task: nothing queued would run
  std::thread thread_;
};

}  // namespace pycomm
