// torch.ops.pycomm.*: collectives as torch.library operators, as DeepSpeed's and vLLM's
// inference all-reduces are. A synchronous CPU all_reduce then costs one dispatcher call:
// no Python wrapper of torch.distributed, no Work, no future. Being operators with a fake
// (meta) kernel registered in pycomm/ops.py, they also live inside torch.compile graphs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "torch/backend/backend.h"

namespace pycomm_torch {

// A synchronous all_reduce of `tensor` over `group`, with no Work: pycomm's own entry for
// CPU tensors on a pycomm group; any other device or backend (gloo, islands, pycomm's
// CUDA path) through that backend's allreduce, so the caller is correct on any group.
void all_reduce_on(at::Tensor& tensor, const std::string& op, c10d::ProcessGroup& group) {
  c10d::ReduceOp reduce = reduce_op_named(op);
  // Below autograd's in-place bookkeeping: bump the version as every in-place ATen op
  // does, so a tensor saved for backward and then reduced in place makes backward raise
  // instead of using the new values silently.
  tensor.unsafeGetTensorImpl()->bump_version();
  auto backend = group.getBackend(tensor.device().type());
  auto* ours = dynamic_cast<ProcessGroupPycomm*>(backend.get());
  if (ours != nullptr && tensor.device().is_cpu()) {
    ours->all_reduce_direct(tensor, reduce);
    return;
  }
  // Other backends may require contiguous memory (gloo reduces the underlying storage
  // as if it were): stage a copy, as pycomm's own path does.
  c10d::AllreduceOptions opts;
  opts.reduceOp = reduce;
  opts.asyncOp = false;
  std::vector<at::Tensor> tensors{tensor.contiguous()};
  backend->allreduce(tensors, opts)->wait();
  if (!tensors[0].is_same(tensor)) tensor.copy_(tensors[0]);
}

c10::intrusive_ptr<c10d::ProcessGroup> live_group(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  const std::string& name = group->getGroupName();
  c10::intrusive_ptr<c10d::ProcessGroup> registered;
  try {
    registered = c10d::resolve_process_group(name);
  } catch (const std::exception&) {
  }
  TORCH_CHECK(registered.get() == group.get(), "pycomm.all_reduce_: process group '", name,
              "' is not live (destroyed, or never registered with torch.distributed)");
  return group;
}

namespace {

// The operator's kernel: in place over the group named `group_name` (ProcessGroup.group_name
// in Python).
void all_reduce_(at::Tensor tensor, c10::string_view op, c10::string_view group_name) {
  all_reduce_on(tensor, std::string(op), *c10d::resolve_process_group(std::string(group_name)));
}

}  // namespace

TORCH_LIBRARY(pycomm, m) { m.def("all_reduce_(Tensor(a!) tensor, str op, str group_name) -> ()"); }

// CompositeExplicitAutograd: one kernel for every device (the backend picks the path),
// below autograd, as c10d's own functional collectives register theirs.
TORCH_LIBRARY_IMPL(pycomm, CompositeExplicitAutograd, m) { m.impl("all_reduce_", all_reduce_); }

}  // namespace pycomm_torch
