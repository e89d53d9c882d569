#include "core/runtime/worker.h"

#include <algorithm>
#include <mutex>
#include <set>
#include <vector>

namespace pycomm {
namespace {

using Clock = std::chrono::steady_clock;

// The worker whose task runs on this thread (null outside any task).
thread_local const Worker* tls_running = nullptr;

// One thread for the process looks at every worker twice a second for stalls: a
// thread per group would cost more than the check does.
class StallWatch {
 public:
  static StallWatch& instance() {
    static StallWatch* watch = new StallWatch();  // never destroyed: see Arena::instance
    return *watch;
  }
  void add(Worker* w) {
    std::lock_guard<std::mutex> lock(mu_);
    workers_.insert(w);
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();
    }
  }
  void remove(Worker* w) {
    std::lock_guard<std::mutex> lock(mu_);
    workers_.erase(w);
  }

 private:
  void loop() {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      std::vector<std::function<void()>> cancels;
      {
        std::lock_guard<std::mutex> lock(mu_);  // remove() waits for a check in progress
        for (Worker* w : workers_) {
          auto mine = w->take_stalled(Clock::now());
          cancels.insert(cancels.end(), mine.begin(), mine.end());
        }
      }
      for (auto& cancel : cancels) cancel();
    }
  }
  std::mutex mu_;
  std::set<Worker*> workers_;
  bool started_ = false;
};

// Sets tls_running for the duration of a task (tasks may nest).
class RunningScope {
 public:
  explicit RunningScope(const Worker* w) : saved_(tls_running) { tls_running = w; }
  ~RunningScope() { tls_running = saved_; }

 private:
  const Worker* saved_;
};

}  // namespace

Worker::Worker(std::chrono::milliseconds stall_after)
    : stall_after_(stall_after), thread_([this] { loop(); }) {
  StallWatch::instance().add(this);
}

Worker::~Worker() {
  stop();
  StallWatch::instance().remove(this);
}

void Worker::submit(std::function<void()> task, Cancel cancel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(Entry{std::move(task), std::move(cancel)});
  }
  cv_.notify_one();
}

const Worker* Worker::current() { return tls_running; }

void Worker::run_here(const std::function<void()>& task) {
  RunningScope scope(this);
  task();
}

bool Worker::run_inline(const std::function<void()>& task) {
  if (on_worker_thread()) {  // nested: the running task is ours, on this thread
    run_here(task);
    return true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_ || stopping_ || !tasks_.empty()) return false;
    busy_ = true;
    running_since_ = Clock::now();
  }
  run_here(task);
  bool queued;
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    queued = !tasks_.empty() || stopping_;
  }
  // Wake the worker only if something waits for it: an unneeded notify is a futex
  // syscall plus a wake-up of the worker on every synchronous op.
  if (queued) cv_.notify_all();
  return true;
}

void Worker::run_queued_until(const std::function<bool()>& done) {
  while (!done()) {
    Entry next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (tasks_.empty()) return;
      next = std::move(tasks_.front());
      tasks_.pop_front();
    }
    run_here(next.run);
  }
}

void Worker::set_stall_after(std::chrono::milliseconds t) {
  std::lock_guard<std::mutex> lock(mu_);
  stall_after_ = t;
}

std::vector<std::function<void()>> Worker::take_stalled(Clock::time_point now) {
  std::vector<Entry> stalled_tasks;
  std::chrono::milliseconds stalled{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!busy_ || tasks_.empty() || now - running_since_ <= stall_after_) return {};
    stalled = std::chrono::duration_cast<std::chrono::milliseconds>(now - running_since_);
    for (auto& e : tasks_) stalled_tasks.push_back(std::move(e));
    tasks_.clear();
  }
  const std::string why =
      "it was queued behind a task that has not finished in " +
      std::to_string(stalled.count() / 1000) +
      " s, longer than the group's timeout: a future callback of an earlier op waits for an "
      "op queued after it, which can never run (ops of one group run in order; a callback "
      "may issue new ops and wait for them, or call work.wait() on later ones)";
  std::vector<std::function<void()>> cancels;
  for (auto& e : stalled_tasks) {
    if (e.cancel) cancels.push_back([cancel = std::move(e.cancel), why] { cancel(why); });
  }
  return cancels;
}

void Worker::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Worker::loop() {
  for (;;) {
    Entry task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return (stopping_ && !busy_) || (!tasks_.empty() && !busy_); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      running_since_ = Clock::now();
    }
    run_here(task.run);
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
  }
}

}  // namespace pycomm
