#ifdef PYCOMM_CUDA

#include "torch/cuda/cuda_collectives.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <string>

#include "core/base/errors.h"
#include "cuda/ipc_ring.cuh"
#include "cuda/reduce_kernels.cuh"
#include "torch/backend/store_rendezvous.h"
#include "torch/backend/tensor_args.h"

namespace pycomm_torch {
namespace {

std::string who(const char* op, int rank) {
  return std::string("pycomm: ") + op + " on rank " + std::to_string(rank);
}

pycomm::DType cuda_dtype(const at::Tensor& t, const char* op, int rank) {
  TORCH_CHECK_VALUE(t.defined() && t.is_cuda(), who(op, rank), ": got a tensor on ",
                    t.defined() ? t.device().str() : "nothing",
                    " among CUDA tensors; every tensor of one call must be on the same GPU");
  return dense_dtype(t, op, rank);
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, int rank) {
  TORCH_CHECK_VALUE(a.device() == b.device(), who(op, rank), ": got tensors on ", a.device().str(),
                    " and ", b.device().str(),
                    "; every tensor of one call must be on the same GPU");
}

// The CPU path's reduce spec (PREMUL_SUM scales the input first), limited to the ops
// the CUDA kernels have.
ReduceSpec cuda_reduce_spec(const c10d::ReduceOp& op, pycomm::DType t, const char* what, int rank) {
  ReduceSpec spec = reduce_spec(op, t, what, rank);
  TORCH_CHECK_VALUE(pycomm::cuda::reduce_supported(t, spec.op), who(what, rank), ": ",
                    pycomm::redop_name(spec.op), " on ", pycomm::dtype_name(t),
                    " has no CUDA kernel (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM on "
                    "float32/64, float16, bfloat16; not AVG on int32/64)");
  return spec;
}

// Like NCCL's Work: returned once the op is enqueued on `stream`; its end is an event
// recorded there after everything the op enqueues (copies back into the caller's tensors
// included). isCompleted() asks the GPU; wait() and synchronize() make the caller's
// current stream wait for the event, without blocking the host.
class CudaWork : public c10d::Work {
 public:
  CudaWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, c10::Device device,
           cudaStream_t stream, uint64_t seq)
      : c10d::Work(rank, type, "pycomm:cuda"),
        outputs_(std::move(outputs)),
        device_(device),
        seq_(seq),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device})) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(done_, stream));
    future_->markCompleted(c10::IValue(outputs_));  // records its own events on `stream`
  }
  ~CudaWork() override { cudaEventDestroy(done_); }

  bool isCompleted() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (completed_) return true;
    }
    cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return false;
    if (e == cudaSuccess) {
      finish();
    } else {
      (void)cudaGetLastError();
      finish(translate_exception(std::make_exception_ptr(pycomm::CommError(
          "pycomm: rank " + std::to_string(rank_) + ": CUDA op (seq " + std::to_string(seq_) +
          ") failed on the GPU: " + cudaGetErrorString(e)))));
    }
    return true;
  }
  void synchronize() override {
    c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(
        cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_.index()).stream(), done_, 0));
  }
  void blockCurrentStream() override { synchronize(); }
  // Like NCCL's: orders the current stream after the op, blocks nothing; raises if the
  // GPU already reported the op failed.
  bool wait(std::chrono::milliseconds) override {
    synchronize();
    if (isCompleted()) {
      if (auto error = exception()) std::rethrow_exception(error);
    }
    return true;
  }
  uint64_t getSequencenumber() const override { return seq_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::Device device_;
  uint64_t seq_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  cudaEvent_t done_{};
};

}  // namespace

bool any_cuda(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda()) return true;
  }
  return false;
}

CudaCollectives::CudaCollectives(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                 std::chrono::milliseconds timeout)
    : store_(std::move(store)), rank_(rank), size_(size), timeout_(timeout) {}

CudaCollectives::~CudaCollectives() = default;

void CudaCollectives::set_timeout(std::chrono::milliseconds t) {
  timeout_ = t;
  if (ring_) ring_->set_timeout(t);
}

void CudaCollectives::abort(const std::string& why) {
  if (ring_) ring_->abort(why);
}

// Runs `body` on the current stream of `t`'s device; the Work's event is recorded after
// all of it, so copies back into the caller's tensors are covered too.
template <class F>
c10::intrusive_ptr<c10d::Work> CudaCollectives::on_stream(c10d::OpType type, const at::Tensor& t,
                                                          std::vector<at::Tensor> outputs, F body) {
  c10::cuda::CUDAGuard guard(t.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
  translated([&] { body(stream); });
  return c10::make_intrusive<CudaWork>(rank_, type, std::move(outputs), t.device(), stream,
                                       ring_ ? ring_->seq() : 0);
}

// Created by the first CUDA op (every rank reaches it in the same call), on that
// tensor's device; one device per rank, as with NCCL.
pycomm::cuda::IpcRing& CudaCollectives::ring(const at::Tensor& t, const char* op) {
  int device = t.device().index();
  if (!ring_) {
    StoreRendezvous rdv(store_);
    translated([&] {
      ring_ = std::make_unique<pycomm::cuda::IpcRing>(
          rdv, rank_, size_, device, pycomm::cuda::RingOptions::from_env(timeout_));
    });
  }
  TORCH_CHECK_VALUE(ring_->device() == device, who(op, rank_), ": got a tensor on cuda:", device,
                    " but this group runs on cuda:", ring_->device(),
                    " (one GPU per rank; set torch.cuda.set_device before the first op)");
  return *ring_;
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::all_reduce(at::Tensor& t,
                                                           const c10d::ReduceOp& op) {
  auto dt = cuda_dtype(t, "all_reduce", rank_);
  auto r = cuda_reduce_spec(op, dt, "all_reduce", rank_);
  return on_stream(c10d::OpType::ALLREDUCE, t, {t}, [&](cudaStream_t s) {
    Staged buf(t);
    r.scale_owned(buf.get());
    ring(t, "all_reduce").all_reduce(buf.ptr(), buf.ptr(), buf.numel(), dt, r.op, s);
    buf.commit();
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::all_reduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
  const char* name = "all_reduce_coalesced";
  auto dt = cuda_dtype(tensors[0], name, rank_);
  for (auto& t : tensors) {
    cuda_dtype(t, name, rank_);
    check_same_dtype(tensors[0], t, name, rank_);
    check_same_device(tensors[0], t, name, rank_);
  }
  check_total_bytes(tensors, name, rank_);
  auto r = cuda_reduce_spec(op, dt, name, rank_);
  return on_stream(c10d::OpType::ALLREDUCE_COALESCED, tensors[0], tensors, [&](cudaStream_t s) {
    at::Tensor flat = flat_copy(tensors);
    r.scale_owned(flat);
    ring(flat, name).all_reduce(flat.data_ptr(), flat.data_ptr(), flat.numel(), dt, r.op, s);
    unflatten_into(flat, tensors);
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::broadcast(at::Tensor& t, int root) {
  auto dt = cuda_dtype(t, "broadcast", rank_);
  check_root(root, "broadcast");
  return on_stream(c10d::OpType::BROADCAST, t, {t}, [&](cudaStream_t s) {
    Staged buf(t);
    ring(t, "broadcast").broadcast(buf.ptr(), buf.numel(), dt, root, s);
    buf.commit();
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::all_gather_base(at::Tensor& out, at::Tensor& in) {
  auto dt = cuda_dtype(in, "all_gather", rank_);
  cuda_dtype(out, "all_gather", rank_);
  check_same_dtype(out, in, "all_gather", rank_);
  check_same_device(in, out, "all_gather", rank_);
  check_numel_ratio(out, in, size_, "all_gather", "output", "input", rank_);
  return on_stream(c10d::OpType::_ALLGATHER_BASE, in, {out}, [&](cudaStream_t s) {
    at::Tensor src = in.contiguous();
    Staged dst(out);
    ring(in, "all_gather").all_gather(dst.ptr(), src.data_ptr(), src.numel(), dt, s);
    dst.commit();
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::all_gather(std::vector<at::Tensor>& outs,
                                                           at::Tensor& in) {
  auto dt = cuda_dtype(in, "all_gather", rank_);
  TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == size_, who("all_gather", rank_), ": got ",
                    outs.size(), " output tensors for a group of ", size_);
  for (auto& o : outs) {
    cuda_dtype(o, "all_gather", rank_);
    check_same_dtype(o, in, "all_gather", rank_);
    check_same_device(in, o, "all_gather", rank_);
    TORCH_CHECK_VALUE(o.numel() == in.numel(), who("all_gather", rank_), ": output ", shape_str(o),
                      " and input ", shape_str(in), " differ in size");
  }
  return on_stream(c10d::OpType::ALLGATHER, in, outs, [&](cudaStream_t s) {
    at::Tensor src = in.contiguous();
    at::Tensor flat = at::empty({src.numel() * size_}, src.options());
    ring(in, "all_gather").all_gather(flat.data_ptr(), src.data_ptr(), src.numel(), dt, s);
    unflatten_into(flat, outs);
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                    const c10d::ReduceOp& op) {
  auto dt = cuda_dtype(in, "reduce_scatter", rank_);
  cuda_dtype(out, "reduce_scatter", rank_);
  check_same_dtype(out, in, "reduce_scatter", rank_);
  check_same_device(in, out, "reduce_scatter", rank_);
  check_numel_ratio(in, out, size_, "reduce_scatter", "input", "output", rank_);
  auto r = cuda_reduce_spec(op, dt, "reduce_scatter", rank_);
  return on_stream(c10d::OpType::_REDUCE_SCATTER_BASE, in, {out}, [&](cudaStream_t s) {
    at::Tensor src = r.input_of(in);
    Staged dst(out);
    ring(in, "reduce_scatter").reduce_scatter(dst.ptr(), src.data_ptr(), dst.numel(), dt, r.op, s);
    dst.commit();
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::reduce_scatter(at::Tensor& out,
                                                               std::vector<at::Tensor>& ins,
                                                               const c10d::ReduceOp& op) {
  auto dt = cuda_dtype(out, "reduce_scatter", rank_);
  TORCH_CHECK_VALUE(static_cast<int>(ins.size()) == size_, who("reduce_scatter", rank_), ": got ",
                    ins.size(), " input tensors for a group of ", size_);
  for (auto& i : ins) {
    cuda_dtype(i, "reduce_scatter", rank_);
    check_same_dtype(i, out, "reduce_scatter", rank_);
    check_same_device(out, i, "reduce_scatter", rank_);
    TORCH_CHECK_VALUE(i.numel() == out.numel(), who("reduce_scatter", rank_), ": input ",
                      shape_str(i), " and output ", shape_str(out), " differ in size");
  }
  auto r = cuda_reduce_spec(op, dt, "reduce_scatter", rank_);
  return on_stream(c10d::OpType::REDUCE_SCATTER, out, {out}, [&](cudaStream_t s) {
    at::Tensor flat = flat_copy(ins);
    r.scale_owned(flat);
    Staged dst(out);
    ring(out, "reduce_scatter")
        .reduce_scatter(dst.ptr(), flat.data_ptr(), dst.numel(), dt, r.op, s);
    dst.commit();
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::all_gather_into_tensor_coalesced(
    std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins) {
  const char* name = "all_gather_into_tensor_coalesced";
  std::vector<pycomm::DType> dts = checked_pairs(outs, ins, name, /*outputs_larger=*/true);
  return on_stream(c10d::OpType::COALESCED, ins[0], outs, [&](cudaStream_t s) {
    for (size_t i = 0; i < ins.size(); ++i) {
      at::Tensor src = ins[i].contiguous();
      Staged dst(outs[i]);
      ring(ins[i], name).all_gather(dst.ptr(), src.data_ptr(), src.numel(), dts[i], s);
      dst.commit();
    }
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins, const c10d::ReduceOp& op) {
  const char* name = "reduce_scatter_tensor_coalesced";
  std::vector<pycomm::DType> dts = checked_pairs(outs, ins, name, /*outputs_larger=*/false);
  std::vector<ReduceSpec> specs;
  for (auto dt : dts) specs.push_back(cuda_reduce_spec(op, dt, name, rank_));
  return on_stream(c10d::OpType::COALESCED, ins[0], outs, [&](cudaStream_t s) {
    for (size_t i = 0; i < ins.size(); ++i) {
      at::Tensor src = specs[i].input_of(ins[i]);
      Staged dst(outs[i]);
      ring(ins[i], name)
          .reduce_scatter(dst.ptr(), src.data_ptr(), dst.numel(), dts[i], specs[i].op, s);
      dst.commit();
    }
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::reduce(at::Tensor& t, const c10d::ReduceOp& op,
                                                       int root) {
  auto dt = cuda_dtype(t, "reduce", rank_);
  check_root(root, "reduce");
  auto r = cuda_reduce_spec(op, dt, "reduce", rank_);
  return on_stream(c10d::OpType::REDUCE, t, {t}, [&](cudaStream_t s) {
    at::Tensor work = t.contiguous().clone();  // non-root tensors come back unchanged
    r.scale_owned(work);
    ring(t, "reduce").all_reduce(work.data_ptr(), work.data_ptr(), work.numel(), dt, r.op, s);
    if (rank_ == root) t.copy_(work.view(t.sizes()));
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::gather(std::vector<at::Tensor>& outs,
                                                       at::Tensor& in, int root) {
  auto dt = cuda_dtype(in, "gather", rank_);
  check_root(root, "gather");
  if (rank_ == root) check_cuda_list(outs, in, "gather", "the output list");
  return on_stream(c10d::OpType::GATHER, in, outs, [&](cudaStream_t s) {
    at::Tensor src = in.contiguous();
    at::Tensor flat = at::empty({src.numel() * size_}, src.options());
    ring(in, "gather").all_gather(flat.data_ptr(), src.data_ptr(), src.numel(), dt, s);
    if (rank_ == root) unflatten_into(flat, outs);
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::scatter(at::Tensor& out,
                                                        std::vector<at::Tensor>& ins, int root) {
  auto dt = cuda_dtype(out, "scatter", rank_);
  check_root(root, "scatter");
  if (rank_ == root) check_cuda_list(ins, out, "scatter", "the input list");
  return on_stream(c10d::OpType::SCATTER, out, {out}, [&](cudaStream_t s) {
    at::Tensor flat =
        rank_ == root ? flat_copy(ins) : at::empty({out.numel() * size_}, out.options());
    ring(out, "scatter").broadcast(flat.data_ptr(), flat.numel(), dt, root, s);
    out.copy_(flat.narrow(0, rank_ * out.numel(), out.numel()).view(out.sizes()));
  });
}

// The coalesced forms' (output, input) pairs: CUDA tensors on one GPU, each pair of one
// dtype, one side `size_` times the other. Returns each pair's dtype.
std::vector<pycomm::DType> CudaCollectives::checked_pairs(const std::vector<at::Tensor>& outs,
                                                          const std::vector<at::Tensor>& ins,
                                                          const char* op,
                                                          bool outputs_larger) const {
  TORCH_CHECK_VALUE(!ins.empty() && outs.size() == ins.size(), who(op, rank_), ": ", outs.size(),
                    " outputs for ", ins.size(), " inputs");
  std::vector<pycomm::DType> dts;
  for (size_t i = 0; i < ins.size(); ++i) {
    dts.push_back(cuda_dtype(ins[i], op, rank_));
    cuda_dtype(outs[i], op, rank_);
    check_same_dtype(outs[i], ins[i], op, rank_);
    check_same_device(ins[0], ins[i], op, rank_);
    check_same_device(ins[i], outs[i], op, rank_);
    if (outputs_larger) {
      check_numel_ratio(outs[i], ins[i], size_, op, "output", "input", rank_);
    } else {
      check_numel_ratio(ins[i], outs[i], size_, op, "input", "output", rank_);
    }
  }
  return dts;
}

void CudaCollectives::check_root(int root, const char* op) const {
  TORCH_CHECK_VALUE(root >= 0 && root < size_, who(op, rank_), ": root ", root,
                    " is not a rank of this group of ", size_);
}

// The root's list: one CUDA tensor per rank, each like `like` (dtype, device, size).
void CudaCollectives::check_cuda_list(const std::vector<at::Tensor>& list, const at::Tensor& like,
                                      const char* op, const char* what) const {
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == size_, who(op, rank_), ": ", what, " has ",
                    list.size(), " tensors for a group of ", size_);
  for (const auto& t : list) {
    cuda_dtype(t, op, rank_);
    check_same_dtype(t, like, op, rank_);
    check_same_device(like, t, op, rank_);
    TORCH_CHECK_VALUE(t.numel() == like.numel(), who(op, rank_), ": ", what, " holds ",
                      shape_str(t), " where ", shape_str(like), " was expected");
  }
}

}  // namespace pycomm_torch

#endif  // PYCOMM_CUDA
