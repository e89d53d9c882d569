#include "torch/backend/work.h"

#include <ATen/record_function.h>

#include <set>

#include "core/base/errors.h"
#include "torch/backend/tensor_args.h"

namespace pycomm_torch {

namespace {
// One list type for every Work's future (creating it per Work costs an allocation).
const c10::TypePtr& tensor_list_type() {
  static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
  return type;
}

// c10d::Work opens a RecordFunction (a heap allocation) whenever it is given a title;
// only a listening profiler reads it, so a synchronous op does not pay for it otherwise.
const char* title_if_profiled(const char* title) { return at::hasCallbacks() ? title : nullptr; }
}  // namespace

PycommWork::PycommWork(int rank, c10d::OpType type, const char* title,
                       std::vector<at::Tensor> outputs, pycomm::Worker* runs_on)
    : c10d::Work(rank, type, title_if_profiled(title)),
      outputs_(std::move(outputs)),
      runs_on_(runs_on),
      title_(title) {}

const char* interned_title(const std::string& name) {
  static std::mutex mu;
  static std::set<std::string>* titles = new std::set<std::string>;  // never freed: Works
  std::lock_guard<std::mutex> lock(mu);                              // may outlive statics
  return titles->insert(name).first->c_str();
}

c10::intrusive_ptr<c10::ivalue::Future> PycommWork::getFuture() {
  bool settle;
  {
    std::lock_guard<std::mutex> lock(future_mu_);
    future_requested_ = true;
    // Made on first request: most synchronous ops are never asked for one.
    if (!future_) future_ = c10::make_intrusive<c10::ivalue::Future>(tensor_list_type());
    settle = done_ && !future_settled_;
    future_settled_ = future_settled_ || settle;
  }
  if (settle) settle_future();  // finished before anyone asked
  return future_;
}

void PycommWork::settle_future() {
  if (error_) {
    future_->setError(error_);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

bool PycommWork::wait(std::chrono::milliseconds timeout) {
  // From a task of the worker that runs this op (a callback of an earlier op waiting
  // for it): nobody else can run it, so run the queue here up to it.
  if (runs_on_ != nullptr && pycomm::Worker::current() == runs_on_) {
    runs_on_->run_queued_until([this] { return isCompleted(); });
  }
  return c10d::Work::wait(timeout);
}

void PycommWork::complete(std::exception_ptr error) {
  bool settle;
  {
    std::lock_guard<std::mutex> lock(future_mu_);
    done_ = true;
    error_ = error;
    settle = future_requested_ && !future_settled_;
    future_settled_ = future_settled_ || settle;
  }
  // Asked for before the end: its callbacks run here, before wait() returns.
  if (settle) settle_future();
  finish(error);
}

std::string stall_failure(const std::string& who, const std::string& why) {
  return "pycomm: " + who + ": " + why +
         "; the group is failed on every rank. Raise the group's timeout, or keep slow "
         "work out of future callbacks; a callback that waits for an op queued after its "
         "own must call that op's work.wait() (which runs it), not wait on its future";
}

void dispatch(pycomm::Worker& worker, const c10::intrusive_ptr<PycommWork>& work, bool async_op,
              std::function<void()> task) {
  if (worker.on_worker_thread()) {  // nested: issued from a callback of this group's op
    task();
    return;
  }
  if (!async_op && worker.run_inline(task)) return;
  worker.submit(std::move(task), [work](const std::string& why) {
    std::string msg = std::string("pycomm: ") + work->title() + " on rank " +
                      std::to_string(work->rank()) + " was cancelled: " + why;
    work->complete(translate_exception(std::make_exception_ptr(pycomm::CommError(msg))));
  });
}

}  // namespace pycomm_torch
