// The collectives of ProcessGroupPycomm: checks in the caller's thread, work on the
// collective worker. List forms are staged through one flat buffer so that each call is
// exactly one core collective.
#include <ATen/ATen.h>

#include "torch/backend/backend.h"
#include "torch/backend/tensor_args.h"

namespace pycomm_torch {

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  at::Tensor t = single(tensors, "all_reduce", getRank());
#ifdef PYCOMM_CUDA
  if (t.defined() && t.is_cuda()) return cuda().all_reduce(t, opts.reduceOp);
#endif
  // Synchronous with nothing queued (dist.all_reduce's common case): run it here and
  // hand back a finished Work, no closure or hand-off to pay for.
  if (!opts.asyncOp && t.defined() && try_all_reduce_inline(t, opts.reduceOp))
    return finished_work(c10d::OpType::ALLREDUCE, "pycomm:all_reduce", t);
  pycomm::DType dt = checked_dtype(t, "all_reduce", getRank());
  ReduceSpec rs = reduce_spec(opts.reduceOp, dt, "all_reduce", getRank());
  return enqueue(c10d::OpType::ALLREDUCE, "pycomm:all_reduce", {t}, opts.asyncOp,
                 [this, t, dt, rs] { reduce_in_place(t, dt, rs); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK_VALUE(!tensors.empty(), "pycomm: all_reduce_coalesced got no tensors");
#ifdef PYCOMM_CUDA
  if (any_cuda(tensors)) return cuda().all_reduce_coalesced(tensors, opts.reduceOp);
#endif
  pycomm::DType dt = checked_dtype(tensors[0], "all_reduce_coalesced", getRank());
  for (const auto& t : tensors) {
    checked_dtype(t, "all_reduce_coalesced", getRank());
    check_same_dtype(tensors[0], t, "all_reduce_coalesced", getRank());
  }
  check_total_bytes(tensors, "all_reduce_coalesced", getRank());
  ReduceSpec rs = reduce_spec(opts.reduceOp, dt, "all_reduce_coalesced", getRank());
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "pycomm:all_reduce_coalesced", tensors,
                 opts.asyncOp, [this, tensors, dt, rs]() mutable {
                   at::Tensor flat = flat_copy(tensors);
                   rs.scale_owned(flat);
                   all_reduce_flat(flat.data_ptr(), flat.numel(), dt, rs.op);
                   unflatten_into(flat, tensors);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  at::Tensor t = single(tensors, "broadcast", getRank());
#ifdef PYCOMM_CUDA
  if (t.defined() && t.is_cuda()) return cuda().broadcast(t, static_cast<int>(opts.rootRank));
#endif
  pycomm::DType dt = checked_dtype(t, "broadcast", getRank());
  int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::BROADCAST, "pycomm:broadcast", {t}, opts.asyncOp,
                 [this, t, dt, root] {
                   Staged buf(t);
                   comm().broadcast(buf.ptr(), buf.numel(), dt, root);
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  at::Tensor t = single(tensors, "reduce", getRank());
#ifdef PYCOMM_CUDA
  if (t.defined() && t.is_cuda())
    return cuda().reduce(t, opts.reduceOp, static_cast<int>(opts.rootRank));
#endif
  pycomm::DType dt = checked_dtype(t, "reduce", getRank());
  ReduceSpec rs = reduce_spec(opts.reduceOp, dt, "reduce", getRank());
  int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::REDUCE, "pycomm:reduce", {t}, opts.asyncOp, [this, t, dt, rs, root] {
    Staged buf(t);
    // PREMUL_SUM scales a copy: non-root tensors must come back unchanged.
    at::Tensor in = rs.input_of(buf.get());
    comm().reduce(in.data_ptr(), buf.ptr(), buf.numel(), dt, rs.op, root);
    if (getRank() == root) buf.commit();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  at::Tensor in = single(inputs, "all_gather", getRank());
#ifdef PYCOMM_CUDA
  if (in.defined() && in.is_cuda()) {
    TORCH_CHECK_VALUE(outputs.size() == 1, "pycomm: all_gather takes one output list per rank");
    return cuda().all_gather(outputs[0], in);
  }
#endif
  pycomm::DType dt = checked_dtype(in, "all_gather", getRank());
  TORCH_CHECK_VALUE(outputs.size() == 1, "pycomm: all_gather takes one output list per rank");
  std::vector<at::Tensor> outs = outputs[0];
  if (check_gather_list(outs, in, getSize(), "all_gather", getRank()))
    return all_gather_uneven(outs, in, dt, opts.asyncOp);
  return enqueue(c10d::OpType::ALLGATHER, "pycomm:all_gather", outs, opts.asyncOp,
                 [this, in, outs, dt]() mutable {
                   at::Tensor src = in.contiguous();
                   at::Tensor flat = at::empty({src.numel() * getSize()}, src.options());
                   comm().all_gather(src.data_ptr(), flat.data_ptr(), src.numel(), dt);
                   unflatten_into(flat, outs);
                 });
}

// Sizes that differ between ranks (torch allows them): an all_to_all in which every rank
// sends its one input to everyone, and each pair checks its size.
c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::all_gather_uneven(std::vector<at::Tensor> outs,
                                                                     at::Tensor in,
                                                                     pycomm::DType dt,
                                                                     bool async_op) {
  pycomm::AllToAllArgs args;
  args.dtype = dt;
  size_t off = 0;
  for (const auto& o : outs) {
    args.send_counts.push_back(in.numel());
    args.send_offsets.push_back(0);
    args.recv_counts.push_back(o.numel());
    args.recv_offsets.push_back(off);
    off += o.numel();
  }
  return enqueue(c10d::OpType::ALLGATHER, "pycomm:all_gather", outs, async_op,
                 [this, in, outs, args, off]() mutable {
                   at::Tensor src = in.contiguous();
                   at::Tensor dst = at::empty({static_cast<int64_t>(off)}, src.options());
                   args.in = src.data_ptr();
                   args.out = dst.data_ptr();
                   comm().all_to_all(args);
                   unflatten_into(dst, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
#ifdef PYCOMM_CUDA
  if (input.defined() && input.is_cuda()) return cuda().all_gather_base(output, input);
#endif
  pycomm::DType dt = checked_dtype(input, "all_gather_into_tensor", getRank());
  checked_dtype(output, "all_gather_into_tensor", getRank());
  check_same_dtype(input, output, "all_gather_into_tensor", getRank());
  check_numel_ratio(output, input, getSize(), "all_gather_into_tensor", "output", "input",
                    getRank());
  at::Tensor out = output, in = input;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "pycomm:all_gather_into_tensor", {out},
                 opts.asyncOp, [this, out, in, dt] {
                   Staged buf(out);
                   at::Tensor src = in.contiguous();
                   comm().all_gather(src.data_ptr(), buf.ptr(), src.numel(), dt);
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather_into_tensor_coalesced";
#ifdef PYCOMM_CUDA
  if (any_cuda(inputs)) return cuda().all_gather_into_tensor_coalesced(outputs, inputs);
#endif
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "pycomm: ", name, ": ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  std::vector<pycomm::DType> dts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    dts.push_back(checked_dtype(inputs[i], name, getRank()));
    check_same_dtype(inputs[i], outputs[i], name, getRank());
    check_numel_ratio(outputs[i], inputs[i], getSize(), name, "output", "input", getRank());
  }
  return enqueue(c10d::OpType::COALESCED, "pycomm:all_gather_into_tensor_coalesced", outputs,
                 opts.asyncOp, [this, outputs, inputs, dts] {
                   for (size_t i = 0; i < inputs.size(); ++i) {
                     Staged buf(outputs[i]);
                     at::Tensor src = inputs[i].contiguous();
                     comm().all_gather(src.data_ptr(), buf.ptr(), src.numel(), dts[i]);
                     buf.commit();
                   }
                 });
}

// One all_gather of every input flattened together: rank r's block of the result is
// its inputs, in order, which is outputs[r] in order.
c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather_coalesced";
  std::vector<at::Tensor> outs =
      coalesced_gather_outputs(outputs, inputs, getSize(), name, getRank());
  pycomm::DType dt = checked_dtype(inputs[0], name, getRank());
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "pycomm:all_gather_coalesced", outs,
                 opts.asyncOp, [this, outs, inputs, dt]() mutable {
                   at::Tensor src = flat_copy(inputs);
                   at::Tensor flat = at::empty({src.numel() * getSize()}, src.options());
                   comm().all_gather(src.data_ptr(), flat.data_ptr(), src.numel(), dt);
                   unflatten_into(flat, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  at::Tensor in = single(inputs, "gather", getRank());
  int root = static_cast<int>(opts.rootRank);
#ifdef PYCOMM_CUDA
  if (in.defined() && in.is_cuda()) {
    TORCH_CHECK_VALUE(outputs.size() <= 1, "pycomm: gather takes one output list per rank");
    std::vector<at::Tensor> outs = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
    return cuda().gather(outs, in, root);
  }
#endif
  pycomm::DType dt = checked_dtype(in, "gather", getRank());
  std::vector<at::Tensor> outs;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1, "pycomm: gather: the root takes one output list");
    outs = outputs[0];
    check_list(outs, in, getSize(), "gather", "the output list", getRank());
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), "pycomm: gather on rank ", getRank(),
                      ": only the root (rank ", root, ") takes an output list");
  }
  return enqueue(c10d::OpType::GATHER, "pycomm:gather", outs, opts.asyncOp,
                 [this, in, outs, dt, root]() mutable {
                   at::Tensor src = in.contiguous();
                   at::Tensor flat;
                   if (getRank() == root)
                     flat = at::empty({src.numel() * getSize()}, src.options());
                   comm().gather(src.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr,
                                 src.numel(), dt, root);
                   if (getRank() == root) unflatten_into(flat, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  at::Tensor out = single(outputs, "scatter", getRank());
  int root = static_cast<int>(opts.rootRank);
#ifdef PYCOMM_CUDA
  if (out.defined() && out.is_cuda()) {
    TORCH_CHECK_VALUE(inputs.size() <= 1, "pycomm: scatter takes one input list per rank");
    std::vector<at::Tensor> ins = inputs.empty() ? std::vector<at::Tensor>{} : inputs[0];
    return cuda().scatter(out, ins, root);
  }
#endif
  pycomm::DType dt = checked_dtype(out, "scatter", getRank());
  std::vector<at::Tensor> ins;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1, "pycomm: scatter: the root takes one input list");
    ins = inputs[0];
    check_list(ins, out, getSize(), "scatter", "the input list", getRank());
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), "pycomm: scatter on rank ", getRank(),
                      ": only the root (rank ", root, ") takes an input list");
  }
  return enqueue(c10d::OpType::SCATTER, "pycomm:scatter", {out}, opts.asyncOp,
                 [this, out, ins, dt, root] {
                   Staged buf(out);
                   at::Tensor flat;
                   if (getRank() == root) flat = flat_copy(ins);
                   comm().scatter(flat.defined() ? flat.data_ptr() : nullptr, buf.ptr(),
                                  buf.numel(), dt, root);
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = single(outputs, "reduce_scatter", getRank());
#ifdef PYCOMM_CUDA
  if (out.defined() && out.is_cuda()) {
    TORCH_CHECK_VALUE(inputs.size() == 1, "pycomm: reduce_scatter takes one input list per rank");
    return cuda().reduce_scatter(out, inputs[0], opts.reduceOp);
  }
#endif
  pycomm::DType dt = checked_dtype(out, "reduce_scatter", getRank());
  TORCH_CHECK_VALUE(inputs.size() == 1, "pycomm: reduce_scatter takes one input list per rank");
  std::vector<at::Tensor> ins = inputs[0];
  check_list(ins, out, getSize(), "reduce_scatter", "the input list", getRank());
  ReduceSpec rs = reduce_spec(opts.reduceOp, dt, "reduce_scatter", getRank());
  return enqueue(c10d::OpType::REDUCE_SCATTER, "pycomm:reduce_scatter", {out}, opts.asyncOp,
                 [this, out, ins, dt, rs] {
                   Staged buf(out);
                   at::Tensor flat = flat_copy(ins);
                   rs.scale_owned(flat);
                   comm().reduce_scatter(flat.data_ptr(), buf.ptr(), buf.numel(), dt, rs.op);
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
#ifdef PYCOMM_CUDA
  if (input.defined() && input.is_cuda())
    return cuda().reduce_scatter_base(output, input, opts.reduceOp);
#endif
  const char* name = "reduce_scatter_tensor";
  pycomm::DType dt = checked_dtype(input, name, getRank());
  checked_dtype(output, name, getRank());
  check_same_dtype(input, output, name, getRank());
  check_numel_ratio(input, output, getSize(), name, "input", "output", getRank());
  ReduceSpec rs = reduce_spec(opts.reduceOp, dt, name, getRank());
  at::Tensor out = output, in = input;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "pycomm:reduce_scatter_tensor", {out},
                 opts.asyncOp, [this, out, in, dt, rs] {
                   Staged buf(out);
                   at::Tensor src = rs.input_of(in);
                   comm().reduce_scatter(src.data_ptr(), buf.ptr(), buf.numel(), dt, rs.op);
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor_coalesced";
#ifdef PYCOMM_CUDA
  if (any_cuda(inputs))
    return cuda().reduce_scatter_tensor_coalesced(outputs, inputs, opts.reduceOp);
#endif
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "pycomm: ", name, ": ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  std::vector<pycomm::DType> dts;
  std::vector<ReduceSpec> specs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    dts.push_back(checked_dtype(inputs[i], name, getRank()));
    check_same_dtype(inputs[i], outputs[i], name, getRank());
    check_numel_ratio(inputs[i], outputs[i], getSize(), name, "input", "output", getRank());
    specs.push_back(reduce_spec(opts.reduceOp, dts.back(), name, getRank()));
  }
  return enqueue(c10d::OpType::COALESCED, "pycomm:reduce_scatter_tensor_coalesced", outputs,
                 opts.asyncOp, [this, outputs, inputs, dts, specs] {
                   for (size_t i = 0; i < inputs.size(); ++i) {
                     Staged buf(outputs[i]);
                     const ReduceSpec& rs = specs[i];
                     at::Tensor src = rs.input_of(inputs[i]);
                     comm().reduce_scatter(src.data_ptr(), buf.ptr(), buf.numel(), dts[i], rs.op);
                     buf.commit();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  pycomm::DType dt = checked_dtype(input, name, getRank());
  checked_dtype(output, name, getRank());
  check_same_dtype(input, output, name, getRank());
  const int n = getSize();
  // Split sizes count rows (dim 0); empty means equal splits.
  auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* which) {
    auto elems = split_elems(t, splits, n, name, which, getRank());
    return std::vector<size_t>(elems.begin(), elems.end());
  };
  pycomm::AllToAllArgs args;
  args.dtype = dt;
  args.send_counts = counts(input, input_splits, "input");
  args.recv_counts = counts(output, output_splits, "output");
  for (auto* pair : {&args.send_counts, &args.recv_counts}) {
    auto& offsets = pair == &args.send_counts ? args.send_offsets : args.recv_offsets;
    size_t off = 0;
    for (size_t c : *pair) offsets.push_back(off), off += c;
  }
  at::Tensor out = output, in = input;
  return enqueue(c10d::OpType::ALLTOALL_BASE, "pycomm:all_to_all_single", {out}, opts.asyncOp,
                 [this, out, in, args]() mutable {
                   Staged buf(out);
                   at::Tensor src = in.contiguous();
                   args.in = src.data_ptr();
                   args.out = buf.ptr();
                   comm().all_to_all(args);
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all";
  const int n = getSize();
  check_all_to_all_lists(inputs, outputs, n, name, getRank());
  pycomm::DType dt = checked_dtype(inputs[0], name, getRank());
  pycomm::AllToAllArgs args;
  args.dtype = dt;
  size_t soff = 0, roff = 0;
  for (int i = 0; i < n; ++i) {
    args.send_counts.push_back(inputs[i].numel());
    args.send_offsets.push_back(soff);
    soff += inputs[i].numel();
    args.recv_counts.push_back(outputs[i].numel());
    args.recv_offsets.push_back(roff);
    roff += outputs[i].numel();
  }
  return enqueue(c10d::OpType::ALLTOALL, "pycomm:all_to_all", outputs, opts.asyncOp,
                 [this, outputs, inputs, args, roff]() mutable {
                   at::Tensor src = flat_copy(inputs);
                   at::Tensor dst = at::empty({static_cast<int64_t>(roff)}, src.options());
                   args.in = src.data_ptr();
                   args.out = dst.data_ptr();
                   comm().all_to_all(args);
                   unflatten_into(dst, outputs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(c10d::OpType::BARRIER, "pycomm:barrier", {}, opts.asyncOp,
                 [this] { comm().barrier(); });
}

}  // namespace pycomm_torch
