// The ops of ProcessGroupIslands that take no hierarchy: gather, scatter and all_to_all
// flat over the world engine (gloo), and send/recv (shared memory inside an island, the
// engine between islands).
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "torch/backend/tensor_args.h"
#include "torch/islands/islands.h"

namespace pycomm_torch {

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  at::Tensor in = single(inputs, "gather", getRank());
  checked_dtype(in, "gather", getRank());
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "pycomm: gather on rank ", getRank(), ": root ",
                    root, " is not a rank of this group of ", getSize());
  std::vector<at::Tensor> outs;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                      "pycomm: gather on rank ", getRank(), ": the root takes one output list of ",
                      getSize(), " tensors");
    outs = outputs[0];
    for (const auto& t : outs) {
      check_same_dtype(in, t, "gather", getRank());
      TORCH_CHECK_VALUE(t.numel() == in.numel(), "pycomm: gather on rank ", getRank(),
                        ": an output has shape ", shape_str(t), " but the input has shape ",
                        shape_str(in));
    }
  }
  return enqueue(c10d::OpType::GATHER, "gather", outs, opts.asyncOp,
                 [this, in, outs, root](const Op& op) mutable {
                   log_path(op, "flat over the world engine");
                   std::vector<std::vector<at::Tensor>> o(1);
                   if (getRank() == root) {
                     for (int r = 0; r < getSize(); ++r)
                       o[0].push_back(as_bytes(at::empty_like(in, at::MemoryFormat::Contiguous)));
                   } else {
                     o.clear();
                   }
                   std::vector<at::Tensor> i{as_bytes(in.contiguous())};
                   c10d::GatherOptions g;
                   g.rootRank = root;
                   remote_step(op, "gather", i[0].numel(),
                               [&] { return engines_.world->gather(o, i, g); });
                   if (getRank() == root) {
                     for (size_t r = 0; r < outs.size(); ++r) {
                       outs[r].copy_(o[0][r].view(in.scalar_type()).view(outs[r].sizes()));
                     }
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  at::Tensor out = single(outputs, "scatter", getRank());
  checked_dtype(out, "scatter", getRank());
  int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < getSize(), "pycomm: scatter on rank ", getRank(), ": root ",
                    root, " is not a rank of this group of ", getSize());
  std::vector<at::Tensor> ins;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                      "pycomm: scatter on rank ", getRank(), ": the root takes one input list of ",
                      getSize(), " tensors");
    ins = inputs[0];
    for (const auto& t : ins) {
      check_same_dtype(out, t, "scatter", getRank());
      TORCH_CHECK_VALUE(t.numel() == out.numel(), "pycomm: scatter on rank ", getRank(),
                        ": an input has shape ", shape_str(t), " but the output has shape ",
                        shape_str(out));
    }
  }
  check_total_bytes(ins, "scatter", getRank());
  return enqueue(
      c10d::OpType::SCATTER, "scatter", {out}, opts.asyncOp, [this, out, ins, root](const Op& op) {
        log_path(op, "flat over the world engine");
        Staged buf(out);
        std::vector<at::Tensor> o{as_bytes(buf.get())};
        std::vector<std::vector<at::Tensor>> i;
        size_t nbytes = 0;
        if (getRank() == root) {
          i.emplace_back();
          for (const auto& t : ins) i[0].push_back(as_bytes(t.contiguous()));
          nbytes = o[0].numel() * getSize();
        }
        c10d::ScatterOptions s;
        s.rootRank = root;
        remote_step(op, "scatter", nbytes, [&] { return engines_.world->scatter(o, i, s); });
        buf.commit();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all_single";
  checked_dtype(input, name, getRank());
  checked_dtype(output, name, getRank());
  check_same_dtype(input, output, name, getRank());
  const int64_t esize = input.element_size();
  std::vector<int64_t> sends =
      split_elems(input, input_splits, getSize(), name, "input", getRank());
  std::vector<int64_t> recvs =
      split_elems(output, output_splits, getSize(), name, "output", getRank());
  for (auto* v : {&sends, &recvs}) {
    for (auto& x : *v) x *= esize;
  }
  at::Tensor out = output, in = input;
  return enqueue(c10d::OpType::ALLTOALL_BASE, name, {out}, opts.asyncOp,
                 [this, out, in, sends, recvs](const Op& op) mutable {
                   log_path(op, "flat over the world engine");
                   Staged buf(out);
                   at::Tensor o = as_bytes(buf.get()), i = as_bytes(in.contiguous());
                   remote_step(op, "all_to_all", i.numel(), [&] {
                     return engines_.world->alltoall_base(o, i, recvs, sends,
                                                          c10d::AllToAllOptions());
                   });
                   buf.commit();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::alltoall(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllToAllOptions& opts) {
  const char* name = "all_to_all";
  const int n = getSize();
  check_all_to_all_lists(inputs, outputs, n, name, getRank());
  std::vector<int64_t> sends, recvs;
  for (int i = 0; i < n; ++i) {
    sends.push_back(inputs[i].numel() * inputs[i].element_size());
    recvs.push_back(outputs[i].numel() * outputs[i].element_size());
  }
  return enqueue(c10d::OpType::ALLTOALL, name, outputs, opts.asyncOp,
                 [this, outputs, inputs, sends, recvs](const Op& op) mutable {
                   log_path(op, "flat over the world engine");
                   std::vector<at::Tensor> flat_in;
                   for (const auto& t : inputs) flat_in.push_back(as_bytes(t.contiguous()));
                   at::Tensor i = at::cat(flat_in);
                   int64_t total = 0;
                   for (int64_t x : recvs) total += x;
                   at::Tensor o = at::empty({total}, i.options());
                   remote_step(op, "all_to_all", i.numel(), [&] {
                     return engines_.world->alltoall_base(o, i, recvs, sends,
                                                          c10d::AllToAllOptions());
                   });
                   int64_t off = 0;
                   for (auto& t : outputs) {
                     int64_t nb = t.numel() * t.element_size();
                     t.copy_(o.narrow(0, off, nb).view(t.scalar_type()).view(t.sizes()));
                     off += nb;
                   }
                 });
}

// --- send / recv -----------------------------------------------------------------------

namespace {

// A receive staged through a contiguous buffer: wait() copies it into the target.
class CopyBackWork : public c10d::Work {
 public:
  CopyBackWork(c10::intrusive_ptr<c10d::Work> inner, at::Tensor target, at::Tensor staged)
      : c10d::Work(-1, c10d::OpType::RECV),
        inner_(std::move(inner)),
        target_(std::move(target)),
        staged_(std::move(staged)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    c10::impl::ExcludeDispatchKeyGuard no_autograd(
        c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    target_.copy_(staged_);
    return true;
  }
  int sourceRank() const override { return inner_->sourceRank(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  at::Tensor target_, staged_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::point_to_point(bool is_send, at::Tensor t,
                                                                   int peer, int tag) {
  const char* name = is_send ? "send" : "recv";
  checked_dtype(t, name, getRank());
  TORCH_CHECK_VALUE(peer >= 0 && peer < getSize(), "pycomm: ", name, " on rank ", getRank(),
                    ": peer ", peer, " is not a rank of this group of ", getSize());
  check_usable();
  std::vector<at::Tensor> ts;
  if (layout_.island_of[peer] == island()) {  // same island: shared memory
    ts.push_back(t);
    int local_peer = layout_.local_of[peer];
    return is_send ? local_->send(ts, local_peer, tag) : local_->recv(ts, local_peer, tag);
  }
  at::Tensor staged = t.is_contiguous() ? t : t.contiguous();
  ts.push_back(as_bytes(staged));
  if (is_send) {
    inter_bytes_ += ts[0].numel();
    return engines_.world->send(ts, peer, tag);
  }
  auto w = engines_.world->recv(ts, peer, tag);
  if (staged.is_same(t)) return w;
  return c10::make_intrusive<CopyBackWork>(w, t, staged);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::send(std::vector<at::Tensor>& tensors, int dst,
                                                         int tag) {
  return point_to_point(true, single(tensors, "send", getRank()), dst, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::recv(std::vector<at::Tensor>& tensors, int src,
                                                         int tag) {
  return point_to_point(false, single(tensors, "recv", getRank()), src, tag);
}

// A message from any rank may come through shared memory or the network engine, and
// taking it from one must not lose one that came through the other meanwhile.
c10::intrusive_ptr<c10d::Work> ProcessGroupIslands::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false,
              "pycomm: recv from any source (dist.recv without src) is not supported by a "
              "group that spans several hosts (islands); name the source rank. Groups within "
              "one host support it.");
}

}  // namespace pycomm_torch
