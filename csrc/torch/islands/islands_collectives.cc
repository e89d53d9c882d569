// The hierarchical collectives of ProcessGroupIslands: checks in the caller's thread,
// steps on the worker. Each algorithm is a few numbered steps over two engines: the
// island's shared memory (local_) and the inter-island engine (engines_).
#include <ATen/ATen.h>

#include <algorithm>

#include "torch/backend/tensor_args.h"
#include "torch/islands/islands.h"

namespace pycomm_torch {
namespace {

// A user's reduction as the engines run it: AVG is a SUM divided at the end, PREMUL_SUM
// a SUM of pre-scaled inputs (gloo knows neither).
struct Reduction {
  c10d::ReduceOp inner;
  bool avg = false;
  ReduceSpec spec;  // its PREMUL_SUM scaling
};

Reduction reduction(const c10d::ReduceOp& op, const at::Tensor& t, const char* name, int rank) {
  ReduceSpec rs = reduce_spec(op, checked_dtype(t, name, rank), name, rank);  // validates
  Reduction r{c10d::ReduceOp(c10d::ReduceOp::SUM)};
  if (op.op_ != c10d::ReduceOp::AVG && !rs.premul) r.inner = c10d::ReduceOp(op.op_);
  r.avg = op.op_ == c10d::ReduceOp::AVG;
  r.spec = rs;
  return r;
}

std::vector<at::Tensor> one(const at::Tensor& t) { return {t}; }

// Options for a step of the island's own group: synchronous, so it runs inline on the
// islands worker instead of being handed to the island group's worker and back.
template <class Options>
Options inline_opts(Options o) {
  o.asyncOp = false;
  return o;
}

// out = the reduction of the rows of `rows` (exact for integers: wraps as the engines do).
void combine_into(at::Tensor out, const at::Tensor& rows, const c10d::ReduceOp& rop) {
  const bool is_bool = rows.scalar_type() == at::kBool;
  at::Tensor acc = rows[0].clone();
  for (int64_t i = 1; i < rows.size(0); ++i) {
    const at::Tensor& x = rows[i];
    switch (rop.op_) {
      case c10d::ReduceOp::SUM:
        is_bool ? acc.logical_or_(x) : acc.add_(x);
        break;
      case c10d::ReduceOp::PRODUCT:
        is_bool ? acc.logical_and_(x) : acc.mul_(x);
        break;
      case c10d::ReduceOp::MIN:
        acc = at::minimum(acc, x);
        break;
      case c10d::ReduceOp::MAX:
        acc = at::maximum(acc, x);
        break;
      case c10d::ReduceOp::BAND:
        acc.bitwise_and_(x);
        break;
      case c10d::ReduceOp::BOR:
        acc.bitwise_or_(x);
        break;
      case c10d::ReduceOp::BXOR:
        acc.bitwise_xor_(x);
        break;
      default:
        TORCH_CHECK(false, "pycomm: islands: reduction ", static_cast<int>(rop.op_),
                    " cannot be combined across islands");
    }
  }
  out.copy_(acc);
}

}  // namespace

// Global rank of local rank j of island i, for equal islands in "[j][i]" order: the
// order in which a local collective over per-shard data lays out the world's blocks.
int64_t ProcessGroupIslands::world_order_index(int island, int local) const {
  return layout_.members[island][local];
}

// --- the algorithms ------------------------------------------------------------------

void ProcessGroupIslands::all_reduce_flat(const Op& op, at::Tensor buf, const c10d::ReduceOp& rop) {
  const int64_t n = buf.numel(), esize = buf.element_size();
  if (n == 0) return;
  c10d::AllreduceOptions ar;
  ar.reduceOp = rop;
  if (!layout_.even()) {
    log_path(op, std::to_string(n) +
                     " elements by leaders: reduce to local rank 0 (shm) -> "
                     "all_reduce among " +
                     std::to_string(layout_.islands()) + " leaders (" +
                     engines_.world->getBackendName() + ") -> broadcast in island (shm)");
    c10d::ReduceOptions ro;
    ro.reduceOp = rop;
    ro.rootRank = 0;
    auto v = one(buf);
    local_step(op, "reduce to the leader",
               local_->reduce(v, inline_opts(ro)));  // 1. into local rank 0
    if (is_leader()) {                               // 2. leaders combine their islands
      remote_step(op, "all_reduce among leaders", n * esize,
                  [&] { return engines_.leaders->allreduce(v, ar); });
    }
    local_step(op, "broadcast from the leader",
               local_->broadcast(v, inline_opts(c10d::BroadcastOptions())));
    return;
  }
  const int64_t l = local_->getSize(), c = (n + l - 1) / l;
  log_path(op, std::to_string(n) + " elements by shards: reduce_scatter in island (shm, " +
                   std::to_string(l) + " ranks) -> all_reduce of a " + std::to_string(c) +
                   "-element shard among " + std::to_string(layout_.islands()) + " islands (" +
                   engines_.shard->getBackendName() + ") -> all_gather in island (shm)");
  at::Tensor work = buf;
  if (c * l != n) {  // pad to l equal shards; the padding is reduced, then dropped
    work = at::zeros({c * l}, buf.options());
    work.narrow(0, 0, n).copy_(buf);
  }
  at::Tensor shard = at::empty({c}, buf.options());
  c10d::ReduceScatterOptions rs;
  rs.reduceOp = rop;
  // 1. reduce-scatter inside the island: local rank j holds shard j of the island's sum
  local_step(op, "reduce_scatter", local_->_reduce_scatter_base(shard, work, inline_opts(rs)));
  // 2. all-reduce shard j among the ranks holding it, one per island
  auto v = one(shard);
  remote_step(op, "all_reduce of the shard", c * esize,
              [&] { return engines_.shard->allreduce(v, ar); });
  // 3. all-gather the shards inside the island
  local_step(op, "all_gather",
             local_->_allgather_base(work, shard, inline_opts(c10d::AllgatherOptions())));
  if (!work.is_same(buf)) buf.copy_(work.narrow(0, 0, n));
}

void ProcessGroupIslands::reduce_scatter_flat(const Op& op, at::Tensor out, at::Tensor in,
                                              const c10d::ReduceOp& rop) {
  const int64_t c = out.numel(), w = getSize(), ni = layout_.islands();
  if (c == 0) return;
  if (!layout_.even()) {
    log_path(op, "by leaders: reduce to local rank 0 (shm) -> all_reduce among leaders (" +
                     engines_.world->getBackendName() + ") -> scatter in island (shm)");
    at::Tensor full = in.clone();
    c10d::ReduceOptions ro;
    ro.reduceOp = rop;
    auto v = one(full);
    local_step(op, "reduce to the leader", local_->reduce(v, inline_opts(ro)));
    std::vector<std::vector<at::Tensor>> blocks;
    if (is_leader()) {
      c10d::AllreduceOptions ar;
      ar.reduceOp = rop;
      remote_step(op, "all_reduce among leaders", full.numel() * full.element_size(),
                  [&] { return engines_.leaders->allreduce(v, ar); });
      blocks.emplace_back();
      for (int g : layout_.members[island()]) blocks[0].push_back(full.view({w, c})[g]);
    }
    auto o = one(out);
    local_step(op, "scatter from the leader",
               local_->scatter(o, blocks, inline_opts(c10d::ScatterOptions())));
    return;
  }
  const int64_t l = local_->getSize();
  log_path(op, "by shards: reduce_scatter in island (shm) -> reduce_scatter of " +
                   std::to_string(ni * c) + " elements among " + std::to_string(ni) + " islands (" +
                   engines_.shard->getBackendName() + ")");
  // Reorder the blocks as [local rank j][island i]: the island's reduce-scatter then
  // hands local rank j every island's block for its counterparts.
  std::vector<int64_t> perm;
  for (int64_t j = 0; j < l; ++j) {
    for (int64_t i = 0; i < ni; ++i) perm.push_back(world_order_index(i, j));
  }
  at::Tensor src = in.view({w, c}).index_select(0, at::tensor(perm)).reshape({-1});
  at::Tensor mid = at::empty({ni * c}, in.options());
  c10d::ReduceScatterOptions rs;
  rs.reduceOp = rop;
  // 1. reduce-scatter inside the island: [island i] blocks for local rank j, summed
  local_step(op, "reduce_scatter", local_->_reduce_scatter_base(mid, src, inline_opts(rs)));
  // 2. exchange among the counterparts (island i gets every island's block i), then
  // combine here. gloo's own reduce_scatter does not complete when called from a
  // backend outside a ProcessGroup (torch 2.13), and an all_to_all moves the same bytes.
  at::Tensor theirs = at::empty({ni * c}, in.options());
  std::vector<int64_t> equal;
  remote_step(op, "reduce_scatter (all_to_all)", (ni - 1) * c * mid.element_size(), [&] {
    return engines_.shard->alltoall_base(theirs, mid, equal, equal, c10d::AllToAllOptions());
  });
  combine_into(out, theirs.view({ni, c}), rop);
}

void ProcessGroupIslands::all_gather_flat(const Op& op, at::Tensor out, at::Tensor in) {
  const int64_t c = in.numel(), w = getSize(), ni = layout_.islands();
  if (c == 0) return;
  if (!layout_.even()) {
    log_path(op, "by leaders: all_gather in island (shm) -> all_gather among leaders (" +
                     engines_.world->getBackendName() + ") -> broadcast in island (shm)");
    const int64_t l = local_->getSize();
    at::Tensor isl = at::empty({l * c}, in.options());
    local_step(op, "all_gather",
               local_->_allgather_base(isl, in, inline_opts(c10d::AllgatherOptions())));
    if (is_leader()) {
      int64_t lmax = 0;
      for (const auto& m : layout_.members) lmax = std::max<int64_t>(lmax, m.size());
      at::Tensor padded = at::zeros({lmax * c}, in.options());
      padded.narrow(0, 0, l * c).copy_(isl);
      at::Tensor all = at::empty({ni * lmax * c}, in.options());
      remote_step(op, "all_gather among leaders", padded.numel(), [&] {
        return engines_.leaders->_allgather_base(all, padded, c10d::AllgatherOptions());
      });
      auto blocks = all.view({ni, lmax, c});
      for (int64_t i = 0; i < ni; ++i) {
        for (size_t k = 0; k < layout_.members[i].size(); ++k) {
          out.view({w, c})[layout_.members[i][k]].copy_(blocks[i][k]);
        }
      }
    }
    auto v = one(out);
    local_step(op, "broadcast from the leader",
               local_->broadcast(v, inline_opts(c10d::BroadcastOptions())));
    return;
  }
  const int64_t l = local_->getSize();
  log_path(op, "by shards: all_gather among " + std::to_string(ni) + " islands (" +
                   engines_.shard->getBackendName() + ") -> all_gather in island (shm)");
  // 1. gather this rank's block from its counterparts in every island
  at::Tensor mid = at::empty({ni * c}, in.options());
  remote_step(op, "all_gather", c,
              [&] { return engines_.shard->_allgather_base(mid, in, c10d::AllgatherOptions()); });
  // 2. all-gather those inside the island; blocks arrive as [local rank j][island i]
  at::Tensor all = at::empty({w * c}, in.options());
  local_step(op, "all_gather",
             local_->_allgather_base(all, mid, inline_opts(c10d::AllgatherOptions())));
  std::vector<int64_t> perm;
  for (int64_t j = 0; j < l; ++j) {
    for (int64_t i = 0; i < ni; ++i) perm.push_back(world_order_index(i, j));
  }
  out.view({w, c}).index_copy_(0, at::tensor(perm), all.view({w, c}));
}

void ProcessGroupIslands::broadcast_flat(const Op& op, at::Tensor buf, int root) {
  const int ri = layout_.island_of[root], rj = layout_.local_of[root];
  const int64_t n = buf.numel();
  if (n == 0) return;
  auto v = one(buf);
  c10d::BroadcastOptions across;
  across.rootRank = ri;  // ranks of the inter-island engines are island indices
  size_t sent = getRank() == root ? n : 0;
  if (layout_.even()) {
    log_path(op, "by shards: broadcast among the local ranks " + std::to_string(rj) + " (" +
                     engines_.shard->getBackendName() + ") -> broadcast in island (shm)");
    if (local_rank() == rj) {  // 1. the root's counterparts in every island get it
      remote_step(op, "broadcast", sent, [&] { return engines_.shard->broadcast(v, across); });
    }
    c10d::BroadcastOptions in_island;
    in_island.rootRank = rj;  // 2. each of them passes it on in its island
    local_step(op, "broadcast", local_->broadcast(v, inline_opts(in_island)));
    return;
  }
  log_path(op, "by leaders: broadcast in the root's island (shm) -> broadcast among leaders (" +
                   engines_.world->getBackendName() + ") -> broadcast in island (shm)");
  c10d::BroadcastOptions from_root;
  from_root.rootRank = rj;
  if (island() == ri) local_step(op, "broadcast", local_->broadcast(v, inline_opts(from_root)));
  if (is_leader()) {
    sent = island() == ri ? n : 0;
    remote_step(op, "broadcast among leaders", sent,
                [&] { return engines_.leaders->broadcast(v, across); });
  }
  if (island() != ri)
    local_step(op, "broadcast", local_->broadcast(v, inline_opts(c10d::BroadcastOptions())));
}

void ProcessGroupIslands::barrier_steps(const Op& op) {
  log_path(op, "barrier in island (shm) -> barrier among leaders -> barrier in island (shm)");
  local_step(op, "barrier", local_->barrier(inline_opts(c10d::BarrierOptions())));
  if (is_leader()) {
    remote_step(op, "barrier among leaders", 0,
                [&] { return engines_.leaders->barrier(c10d::BarrierOptions()); });
  }
  local_step(op, "barrier", local_->barrier(inline_opts(c10d::BarrierOptions())));
}

// --- the c10d entry points -----------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  at::Tensor t = single(tensors, "all_reduce", getRank());
  Reduction red = reduction(opts.reduceOp, t, "all_reduce", getRank());
  return enqueue(c10d::OpType::ALLREDUCE, "all_reduce", {t}, opts.asyncOp,
                 [this, t, red](const Op& op) {
                   Staged buf(t);
                   at::Tensor flat = buf.get().view({-1});
                   red.spec.scale_owned(flat);
                   all_reduce_flat(op, flat, red.inner);
                   if (red.avg) flat.div_(getSize());
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const char* name = "all_reduce_coalesced";
  TORCH_CHECK_VALUE(!tensors.empty(), "pycomm: ", name, " on rank ", getRank(), " got no tensors");
  for (const auto& t : tensors) check_same_dtype(tensors[0], t, name, getRank());
  check_total_bytes(tensors, name, getRank());
  Reduction red = reduction(opts.reduceOp, tensors[0], name, getRank());
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, name, tensors, opts.asyncOp,
                 [this, tensors, red](const Op& op) mutable {
                   at::Tensor flat = flat_copy(tensors);
                   red.spec.scale_owned(flat);
                   all_reduce_flat(op, flat, red.inner);
                   if (red.avg) flat.div_(getSize());
                   unflatten_into(flat, tensors);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::reduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::ReduceOptions& opts) {
  at::Tensor t = single(tensors, "reduce", getRank());
  Reduction red = reduction(opts.reduceOp, t, "reduce", getRank());
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "pycomm: reduce on rank ", getRank(), ": root ",
                    root, " is not a rank of this group of ", getSize());
  // An all_reduce of a copy: the root keeps the result, the others' tensors stay as
  // they were. (A rooted version would save the final broadcast; reduce is rare.)
  return enqueue(c10d::OpType::REDUCE, "reduce", {t}, opts.asyncOp,
                 [this, t, red, root](const Op& op) mutable {
                   at::Tensor flat = t.reshape({-1}).clone();
                   red.spec.scale_owned(flat);
                   all_reduce_flat(op, flat, red.inner);
                   if (red.avg) flat.div_(getSize());
                   if (getRank() == root) t.copy_(flat.view(t.sizes()));
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  at::Tensor t = single(tensors, "broadcast", getRank());
  checked_dtype(t, "broadcast", getRank());
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "pycomm: broadcast on rank ", getRank(),
                    ": root ", root, " is not a rank of this group of ", getSize());
  return enqueue(c10d::OpType::BROADCAST, "broadcast", {t}, opts.asyncOp,
                 [this, t, root](const Op& op) {
                   Staged buf(t);
                   broadcast_flat(op, as_bytes(buf.get()), root);
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather_into_tensor";
  checked_dtype(input, name, getRank());
  checked_dtype(output, name, getRank());
  check_same_dtype(input, output, name, getRank());
  check_numel_ratio(output, input, getSize(), name, "output", "input", getRank());
  at::Tensor out = output, in = input;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, name, {out}, opts.asyncOp,
                 [this, out, in](const Op& op) {
                   Staged buf(out);
                   all_gather_flat(op, as_bytes(buf.get()), as_bytes(in.contiguous()));
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  at::Tensor in = single(inputs, "all_gather", getRank());
  checked_dtype(in, "all_gather", getRank());
  TORCH_CHECK_VALUE(outputs.size() == 1, "pycomm: all_gather on rank ", getRank(),
                    " takes one output list");
  std::vector<at::Tensor> outs = outputs[0];
  if (check_gather_list(outs, in, getSize(), "all_gather", getRank())) {
    // Sizes differ between ranks: every rank sends its one input to everyone.
    std::vector<at::Tensor> ins(getSize(), in);
    c10d::AllToAllOptions a2a;
    a2a.timeout = opts.timeout;
    a2a.asyncOp = opts.asyncOp;
    return alltoall(outs, ins, a2a);
  }
  return enqueue(c10d::OpType::ALLGATHER, "all_gather", outs, opts.asyncOp,
                 [this, in, outs](const Op& op) mutable {
                   at::Tensor src = in.contiguous();
                   at::Tensor flat = at::empty({src.numel() * getSize()}, src.options());
                   all_gather_flat(op, as_bytes(flat), as_bytes(src));
                   unflatten_into(flat, outs);
                 });
}

// As ProcessGroupPycomm's: one all_gather of the inputs flattened together.
c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outs =
      coalesced_gather_outputs(outputs, inputs, getSize(), "all_gather_coalesced", getRank());
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "all_gather_coalesced", outs, opts.asyncOp,
                 [this, inputs, outs](const Op& op) mutable {
                   at::Tensor src = flat_copy(inputs);
                   at::Tensor flat = at::empty({src.numel() * getSize()}, src.options());
                   all_gather_flat(op, as_bytes(flat), as_bytes(src));
                   unflatten_into(flat, outs);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* name = "all_gather_into_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "pycomm: ", name, " on rank ", getRank(), ": ",
                    outputs.size(), " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checked_dtype(inputs[i], name, getRank());
    check_same_dtype(inputs[i], outputs[i], name, getRank());
    check_numel_ratio(outputs[i], inputs[i], getSize(), name, "output", "input", getRank());
  }
  return enqueue(c10d::OpType::COALESCED, name, outputs, opts.asyncOp,
                 [this, outputs, inputs](const Op& op) {
                   for (size_t i = 0; i < inputs.size(); ++i) {
                     Staged buf(outputs[i]);
                     all_gather_flat(op, as_bytes(buf.get()), as_bytes(inputs[i].contiguous()));
                     buf.commit();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor";
  Reduction red = reduction(opts.reduceOp, input, name, getRank());
  checked_dtype(output, name, getRank());
  check_same_dtype(input, output, name, getRank());
  check_numel_ratio(input, output, getSize(), name, "input", "output", getRank());
  at::Tensor out = output, in = input;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, name, {out}, opts.asyncOp,
                 [this, out, in, red](const Op& op) {
                   Staged buf(out);
                   at::Tensor src = red.spec.input_of(in);
                   reduce_scatter_flat(op, buf.get().view({-1}), src.view({-1}), red.inner);
                   if (red.avg) buf.get().div_(getSize());
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = single(outputs, "reduce_scatter", getRank());
  Reduction red = reduction(opts.reduceOp, out, "reduce_scatter", getRank());
  TORCH_CHECK_VALUE(inputs.size() == 1, "pycomm: reduce_scatter on rank ", getRank(),
                    " takes one input list");
  std::vector<at::Tensor> ins = inputs[0];
  check_list(ins, out, getSize(), "reduce_scatter", "the input list", getRank());
  return enqueue(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", {out}, opts.asyncOp,
                 [this, out, ins, red](const Op& op) {
                   Staged buf(out);
                   at::Tensor src = flat_copy(ins);
                   red.spec.scale_owned(src);
                   reduce_scatter_flat(op, buf.get().view({-1}), src, red.inner);
                   if (red.avg) buf.get().div_(getSize());
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "pycomm: ", name, " on rank ", getRank(), ": ",
                    outputs.size(), " outputs for ", inputs.size(), " inputs");
  std::vector<Reduction> reds;
  for (size_t i = 0; i < inputs.size(); ++i) {
    reds.push_back(reduction(opts.reduceOp, inputs[i], name, getRank()));
    check_same_dtype(inputs[i], outputs[i], name, getRank());
    check_numel_ratio(inputs[i], outputs[i], getSize(), name, "input", "output", getRank());
  }
  return enqueue(c10d::OpType::COALESCED, name, outputs, opts.asyncOp,
                 [this, outputs, inputs, reds](const Op& op) {
                   for (size_t i = 0; i < inputs.size(); ++i) {
                     Staged buf(outputs[i]);
                     const Reduction& red = reds[i];
                     at::Tensor src = red.spec.input_of(inputs[i]);
                     reduce_scatter_flat(op, buf.get().view({-1}), src.view({-1}), red.inner);
                     if (red.avg) buf.get().div_(getSize());
                     buf.commit();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(c10d::OpType::BARRIER, "barrier", {}, opts.asyncOp,
                 [this](const Op& op) { barrier_steps(op); });
}

}  // namespace pycomm_torch
