#ifdef PYCOMM_CUDA

#include "cuda_collectives.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <string>

#include "core/runtime/errors.h"
#include "cuda/ipc_ring.cuh"
#include "cuda/reduce_kernels.cuh"
#include "store_rendezvous.h"
#include "tensor_args.h"

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

// Complete once enqueued; the op's end is an event on the stream it ran on.
class CudaWork : public c10d::Work {
 public:
  CudaWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, c10::Device device,
           cudaStream_t stream)
      : c10d::Work(rank, type, "pycomm:cuda"),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device})) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(done_, stream));
    future_->markCompleted(c10::IValue(outputs_));  // records its own events on `stream`
    finish();
  }
  ~CudaWork() override { cudaEventDestroy(done_); }
  bool wait(std::chrono::milliseconds) override {
    C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream().stream(), done_, 0));
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  cudaEvent_t done_{};
};

template <class F>
c10::intrusive_ptr<c10d::Work> run_on_stream(int rank, c10d::OpType type, const at::Tensor& t,
                                             std::vector<at::Tensor> outputs, F body) {
  c10::cuda::CUDAGuard guard(t.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
  translated([&] { body(stream); });
  return c10::make_intrusive<CudaWork>(rank, type, std::move(outputs), t.device(), stream);
}

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
  return run_on_stream(rank_, c10d::OpType::ALLREDUCE, t, {t}, [&](cudaStream_t s) {
    Staged buf(t);
    if (r.premul) buf.get().mul_(r.factor);
    ring(t, "all_reduce").all_reduce(buf.ptr(), buf.ptr(), buf.numel(), dt, r.op, s);
    buf.commit();
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::all_reduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
  for (auto& t : tensors) {
    cuda_dtype(t, "all_reduce_coalesced", rank_);
    check_same_dtype(tensors[0], t, "all_reduce_coalesced", rank_);
  }
  at::Tensor flat = flat_copy(tensors);
  auto work = all_reduce(flat, op);
  unflatten_into(flat, tensors);
  return work;
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::broadcast(at::Tensor& t, int root) {
  auto dt = cuda_dtype(t, "broadcast", rank_);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, who("broadcast", rank_), ": root ", root,
                    " is not a rank of this group of ", size_);
  return run_on_stream(rank_, c10d::OpType::BROADCAST, t, {t}, [&](cudaStream_t s) {
    Staged buf(t);
    ring(t, "broadcast").broadcast(buf.ptr(), buf.numel(), dt, root, s);
    buf.commit();
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::all_gather_base(at::Tensor& out, at::Tensor& in) {
  auto dt = cuda_dtype(in, "all_gather", rank_);
  cuda_dtype(out, "all_gather", rank_);
  check_same_dtype(out, in, "all_gather", rank_);
  check_numel_ratio(out, in, size_, "all_gather", "output", "input", rank_);
  return run_on_stream(rank_, c10d::OpType::_ALLGATHER_BASE, in, {out}, [&](cudaStream_t s) {
    at::Tensor src = in.contiguous();
    Staged dst(out);
    ring(in, "all_gather").all_gather(dst.ptr(), src.data_ptr(), src.numel(), dt, s);
    dst.commit();
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::all_gather(std::vector<at::Tensor>& outs,
                                                           at::Tensor& in) {
  TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == size_, who("all_gather", rank_), ": got ",
                    outs.size(), " output tensors for a group of ", size_);
  for (auto& o : outs) {
    check_same_dtype(o, in, "all_gather", rank_);
    TORCH_CHECK_VALUE(o.numel() == in.numel(), who("all_gather", rank_), ": output ", shape_str(o),
                      " and input ", shape_str(in), " differ in size");
  }
  at::Tensor flat = at::empty({in.numel() * size_}, in.options());
  auto work = all_gather_base(flat, in);
  unflatten_into(flat, outs);
  return work;
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                                    const c10d::ReduceOp& op) {
  auto dt = cuda_dtype(in, "reduce_scatter", rank_);
  cuda_dtype(out, "reduce_scatter", rank_);
  check_same_dtype(out, in, "reduce_scatter", rank_);
  check_numel_ratio(in, out, size_, "reduce_scatter", "input", "output", rank_);
  auto r = cuda_reduce_spec(op, dt, "reduce_scatter", rank_);
  return run_on_stream(rank_, c10d::OpType::_REDUCE_SCATTER_BASE, in, {out}, [&](cudaStream_t s) {
    at::Tensor src = r.premul ? in.mul(r.factor) : in.contiguous();
    Staged dst(out);
    ring(in, "reduce_scatter").reduce_scatter(dst.ptr(), src.data_ptr(), dst.numel(), dt, r.op, s);
    dst.commit();
  });
}

c10::intrusive_ptr<c10d::Work> CudaCollectives::reduce_scatter(at::Tensor& out,
                                                               std::vector<at::Tensor>& ins,
                                                               const c10d::ReduceOp& op) {
  TORCH_CHECK_VALUE(static_cast<int>(ins.size()) == size_, who("reduce_scatter", rank_), ": got ",
                    ins.size(), " input tensors for a group of ", size_);
  for (auto& i : ins) {
    check_same_dtype(i, out, "reduce_scatter", rank_);
    TORCH_CHECK_VALUE(i.numel() == out.numel(), who("reduce_scatter", rank_), ": input ",
                      shape_str(i), " and output ", shape_str(out), " differ in size");
  }
  at::Tensor flat = flat_copy(ins);
  return reduce_scatter_base(out, flat, op);
}

}  // namespace pycomm_torch

#endif  // PYCOMM_CUDA
