// The Work (and its Future) that every pycomm op returns; completed by the thread that
// ran the op, which is what DDP's reducer and `async_op=True` rely on.
#pragma once

#include <ATen/core/ivalue.h>

#include <exception>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

namespace pycomm_torch {

class PycommWork : public c10d::Work {
 public:
  PycommWork(int rank, c10d::OpType type, const char* profiling_title,
             std::vector<at::Tensor> outputs);

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

  // Marks the op done: wakes wait(), then completes (or fails) the future.
  void complete(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace pycomm_torch
