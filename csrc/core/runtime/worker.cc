#include "core/runtime/worker.h"

namespace pycomm {

Worker::Worker() : thread_([this] { loop(); }) {}

Worker::~Worker() { stop(); }

void Worker::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

bool Worker::run_inline(const std::function<void()>& task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (busy_ || stopping_ || !tasks_.empty()) return false;
    busy_ = true;
  }
  task();
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
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return (stopping_ && !busy_) || (!tasks_.empty() && !busy_); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
    }
    task();
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
  }
}

}  // namespace pycomm
