#include "work.h"

#include "core/runtime/errors.h"
#include "tensor_args.h"

namespace pycomm_torch {

PycommWork::PycommWork(int rank, c10d::OpType type, const char* profiling_title,
                       std::vector<at::Tensor> outputs, pycomm::Worker* runs_on)
    : c10d::Work(rank, type, profiling_title),
      outputs_(std::move(outputs)),
      future_(
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
      runs_on_(runs_on),
      title_(profiling_title) {}

c10::intrusive_ptr<c10::ivalue::Future> PycommWork::getFuture() {
  future_requested_.store(true);
  return future_;
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
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish(error);
}

void dispatch(pycomm::Worker& worker, const c10::intrusive_ptr<PycommWork>& work, bool async_op,
              std::function<void()> task) {
  if (worker.on_worker_thread()) {  // nested: issued from a callback of this group's op
    task();
    return;
  }
  if (!async_op && worker.run_inline(task)) return;
  worker.submit(std::move(task), [work](const std::string& why) {
    std::string msg = "pycomm: " + work->title() + " on rank " + std::to_string(work->rank()) +
                      " was cancelled: " + why;
    work->complete(translate_exception(std::make_exception_ptr(pycomm::CommError(msg))));
  });
}

}  // namespace pycomm_torch
