#include "core/communicator/worker.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "core/base/wait_policy.h"

namespace pycomm {
namespace {

// The worker whose task runs on this thread (null outside any task).
thread_local const Worker* tls_running = nullptr;

// One thread for the process looks at every worker twice a second for stalls: a
// thread per group would cost more than the check does.
class StallWatch {
 public:
  static StallWatch& instance() {
    std::call_once(once_, [] {
      if (watch_ == nullptr) watch_ = new StallWatch();  // never destroyed: see Arena
    });
    return *watch_;
  }
  // A forked child has no watch thread (and the lock may be held by a thread that is
  // not there): it starts a watch of its own when it next needs one.
  static void after_fork_in_child() { watch_ = new StallWatch(); }
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
  std::vector<Worker*> all() {
    std::lock_guard<std::mutex> lock(mu_);
    return {workers_.begin(), workers_.end()};
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
  static inline StallWatch* watch_ = nullptr;
  static inline std::once_flag once_;
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

void Worker::watch_stalls(OnStall on_stall, Progress progress) {
  std::lock_guard<std::mutex> lock(mu_);
  on_stall_ = std::move(on_stall);
  progress_ = std::move(progress);
}

void Worker::submit(std::function<void()> task, Cancel cancel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!joined_) {
      tasks_.push_back(Entry{std::move(task), std::move(cancel)});
      cv_.notify_one();
      return;
    }
  }
  // Stopped: nothing would ever run it (a callback issuing an op during shutdown).
  if (cancel) {
    cancel("the process group was shut down (destroy_process_group) before it could run");
  } else {
    run_here(task);
  }
}

const Worker* Worker::current() { return tls_running; }

void Worker::after_fork_in_child() { StallWatch::after_fork_in_child(); }

bool Worker::idle() {
  std::lock_guard<std::mutex> lock(mu_);
  return !busy_ && tasks_.empty();
}

void Worker::wait_all_idle(std::chrono::milliseconds cap) {
  for (Worker* w : StallWatch::instance().all()) {
    std::chrono::milliseconds limit;
    {
      std::lock_guard<std::mutex> lock(w->mu_);
      limit = std::min(cap, w->stall_after_);
    }
    const auto deadline = Clock::now() + limit;
    while (!w->idle() && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
}

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
    started_locked();
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
    if (!busy_ || tasks_.empty()) return {};
    if (progress_) {
      uint64_t p = progress_();
      if (p != progress_seen_) {  // a collective finished since: not stuck
        progress_seen_ = p;
        running_since_ = now;
        return {};
      }
    }
    if (now - running_since_ <= stall_after_) return {};
    stalled = std::chrono::duration_cast<std::chrono::milliseconds>(now - running_since_);
    for (auto& e : tasks_) stalled_tasks.push_back(std::move(e));
    tasks_.clear();
  }
  char secs[64];
  std::snprintf(secs, sizeof(secs), "%.1f s, longer than the group's timeout (%.1f s)",
                stalled.count() / 1000.0, stall_after_.count() / 1000.0);
  std::string why = std::string("a task on its collective worker (a future callback, or a ") +
                    "coalesced or composed op) has held the group's order for " + secs +
                    " without a collective finishing, with " +
                    std::to_string(stalled_tasks.size()) +
                    " op(s) queued behind it, which would run past their timeout";
  auto message = std::make_shared<std::string>("pycomm: " + why);
  std::vector<std::function<void()>> out;
  if (on_stall_) out.push_back([on_stall = on_stall_, why, message] { *message = on_stall(why); });
  for (auto& e : stalled_tasks) {
    if (e.cancel) out.push_back([cancel = std::move(e.cancel), message] { cancel(*message); });
  }
  return out;
}

void Worker::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Worker::started_locked() {
  busy_ = true;
  running_since_ = coarse_now();  // compared with the stall limit (seconds) only
  progress_seen_ = progress_ ? progress_() : 0;
}

void Worker::loop() {
  for (;;) {
    Entry task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return (stopping_ && !busy_) || (!tasks_.empty() && !busy_); });
      if (tasks_.empty()) {
        joined_ = true;  // under the lock: a later submit() cannot queue what never runs
        return;
      }
      task = std::move(tasks_.front());
      tasks_.pop_front();
      started_locked();
    }
    run_here(task.run);
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
  }
}

}  // namespace pycomm
