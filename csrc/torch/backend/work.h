// The Work (and its Future) that every pycomm op returns, and how an op is run for it.
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "core/communicator/worker.h"

namespace pycomm_torch {

class PycommWork : public c10d::Work {
 public:
  // `runs_on`: the worker that runs the op, if any (a wait from one of its own tasks
  // must run the op itself). `title` must outlive the Work (a string literal, or
  // interned_title's): copying it would cost every op a heap allocation.
  PycommWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
             pycomm::Worker* runs_on = nullptr);

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override { return outputs_; }
  int sourceRank() const override { return source_rank_.load(); }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;

  // Completes (or fails) the future, running its callbacks on this thread, then marks
  // the Work finished: once wait() returns, every callback has run and the future's
  // value can be read (gloo's order).
  void complete(std::exception_ptr error);
  void set_source_rank(int rank) { source_rank_.store(rank); }
  // Whether anyone has asked for the future (only then can callbacks be attached
  // before completion).
  bool future_requested() const {
    std::lock_guard<std::mutex> lock(future_mu_);
    return future_requested_;
  }
  const char* title() const { return title_; }
  int rank() const { return rank_; }

 private:
  void settle_future();  // completes or fails future_ with the op's outcome

  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // guarded by future_mu_
  pycomm::Worker* runs_on_;
  const char* title_;
  std::atomic<int> source_rank_{-1};
  // The future is settled only once someone asks for it: settling walks the outputs
  // for their storages, microseconds a synchronous op would pay for nothing.
  mutable std::mutex future_mu_;
  bool future_requested_ = false;
  bool done_ = false;
  bool future_settled_ = false;
  std::exception_ptr error_;
};

// "pycomm:" + name, kept for the life of the process (a Work's title must outlive it);
// for titles made at run time, one allocation per distinct name, not per op.
const char* interned_title(const std::string& name);

// The group's failure message when the worker's stall watch fires on rank `who`.
std::string stall_failure(const std::string& who, const std::string& why);

// Runs `task` (which completes `work`) on `worker` in call order: at once when issued
// from one of the worker's own tasks (a future callback), right here when synchronous
// and nothing is queued, else queued. A queued task the worker gives up on (see
// Worker's stall watch) fails its Work with the reason instead of never running.
void dispatch(pycomm::Worker& worker, const c10::intrusive_ptr<PycommWork>& work, bool async_op,
              std::function<void()> task);

}  // namespace pycomm_torch
