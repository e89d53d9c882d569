// Lifecycle, the worker hand-off and send/recv of ProcessGroupPycomm; the collectives
// are in backend_collectives.cc.
#include "torch/backend/backend.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <unistd.h>

#include <map>
#include <string>

#include "core/communicator/fork_guard.h"
#include "core/communicator/group_segment.h"
#include "torch/backend/store_rendezvous.h"
#include "torch/backend/tensor_args.h"
#include "torch/backend/work.h"

namespace pycomm_torch {

void Leftovers::park(c10::intrusive_ptr<c10d::Work> work, std::function<void()> body,
                     std::shared_ptr<void> extra) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.push_back(Entry{std::move(work), std::move(body), std::move(extra)});
  any_.store(true, std::memory_order_release);
}

void Leftovers::drop_all() {
  // Called before every op: with nothing parked (the usual case) no lock is taken. An
  // entry parked concurrently is dropped by the next call, as it would be after the lock.
  if (!any_.load(std::memory_order_acquire)) return;
  std::vector<Entry> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(entries_);
    any_.store(false, std::memory_order_relaxed);
  }
}  // destroyed here, outside the lock, on the caller's thread

ProcessGroupPycomm::ProcessGroupPycomm(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                       int size, std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size) {
  StoreRendezvous rdv(store);
  translated([&] {
    try {
      auto cfg = pycomm::Config::from_env();
      comm_ = std::make_unique<pycomm::Communicator>(rdv, rank, size, cfg, timeout);
    } catch (const std::exception& e) {
      pycomm::report_init_failure(rdv, rank, e.what());  // the others fail at once too
      throw;
    }
  });
  if (comm_->config().stripes > 1) {
    translated([&] { stripes_ = std::make_unique<Stripes>(store, *comm_, timeout); });
  }
  p2p_ = std::make_unique<pycomm::P2PEngine>(comm_->shared(), comm_->logger(), timeout,
                                             comm_->config().wait_slice_us);
  worker_ = std::make_unique<pycomm::Worker>(timeout);
  // A stall fails the group through its failure record, so every rank fails alike.
  worker_->watch_stalls(
      [this](const std::string& why) {
        fail_with(stall_failure("rank " + std::to_string(getRank()), why));
        return comm_->shared().abort_message();
      },
      [comm = comm_.get()] { return comm->seq(); });
#ifdef PYCOMM_CUDA
  cuda_ = std::make_unique<CudaCollectives>(store, rank, size, timeout);
#endif
}

// Destroyed without shutdown(): the process is exiting (or dropped the group) without
// destroy_process_group, which peers are told in those words.
ProcessGroupPycomm::~ProcessGroupPycomm() { close(pycomm::Departure::EXITED); }

void ProcessGroupPycomm::setTimeout(std::chrono::milliseconds timeout) {
  if (comm_) comm_->set_timeout(timeout);
  if (stripes_) stripes_->set_timeout(timeout);
  if (p2p_) p2p_->set_timeout(timeout);
  if (worker_) worker_->set_stall_after(timeout);
#ifdef PYCOMM_CUDA
  if (cuda_) cuda_->set_timeout(timeout);
#endif
}

void ProcessGroupPycomm::shutdown() { close(pycomm::Departure::DESTROYED); }

// Refuses new ops, finishes what is queued (each op is bounded by its timeout), then
// releases the threads and the segment. Every thread that could call into the worker or
// the engine (the worker itself, the engine, the p2p callback thread, whose callbacks
// may issue ops) is stopped before anything it uses is released.
void ProcessGroupPycomm::close(pycomm::Departure how) {
  closing_.store(true);
  if (getpid() != creator_pid_) {
    // A forked child's copy: its threads do not exist here and its rank is the
    // parent's, so nothing is joined, departed or unmapped (fork_guard.h).
    (void)worker_.release();
    (void)p2p_.release();
    (void)p2p_callbacks_.release();
    if (stripes_) stripes_->forget_after_fork();
    (void)stripes_.release();
    (void)comm_.release();
#ifdef PYCOMM_CUDA
    (void)cuda_.release();
#endif
    return;
  }
#ifdef PYCOMM_CUDA
  cuda_.reset();  // waits (bounded) for the GPU and the peers, then unmaps the windows
#endif
  if (worker_) worker_->stop();
  if (p2p_) p2p_->stop();  // fails what is still posted; may hand completions on
  if (p2p_callbacks_) p2p_callbacks_->stop();
  p2p_callbacks_.reset();
  p2p_.reset();
  worker_.reset();
  if (stripes_) stripes_->close(how);  // no op runs: the worker and its caller are done
  stripes_.reset();
  if (comm_) comm_->depart(how);
  comm_.reset();
  leftovers_.drop_all();
}

void ProcessGroupPycomm::abort() {
#ifdef PYCOMM_CUDA
  if (cuda_)
    cuda_->abort("pycomm: rank " + std::to_string(getRank()) + " aborted the process group");
#endif
  fail_with("pycomm: rank " + std::to_string(getRank()) + " aborted the process group");
  shutdown();
}

void ProcessGroupPycomm::fail_with(const std::string& msg) {
  if (stripes_)
    stripes_->fail_all(msg);  // the group's own communicator first, then each stripe's
  else if (comm_)
    comm_->shared().set_abort(msg);
}

void ProcessGroupPycomm::check_open() const {
  if (std::string forked = pycomm::forked_group_error(creator_pid_, getRank()); !forked.empty())
    TORCH_CHECK(false, forked);
  TORCH_CHECK(!closing_.load(std::memory_order_relaxed), "pycomm: rank ", getRank(),
              ": the process group was shut down (destroy_process_group) and cannot run ops");
}

pycomm::Communicator& ProcessGroupPycomm::comm() {
  TORCH_CHECK(comm_ != nullptr, "pycomm: rank ", getRank(),
              ": the process group was shut down (destroy_process_group) and cannot run ops");
  return *comm_;
}

#ifdef PYCOMM_CUDA
CudaCollectives& ProcessGroupPycomm::cuda() {
  TORCH_CHECK(cuda_ != nullptr, "pycomm: rank ", getRank(),
              ": the process group was shut down (destroy_process_group) and cannot run ops");
  return *cuda_;
}
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::enqueue(c10d::OpType type, const char* title,
                                                           std::vector<at::Tensor> outputs,
                                                           bool async_op,
                                                           std::function<void()> body) {
  check_open();  // fail now, in the caller (or the callback), if shut down
  // Not from a callback on the worker: only the caller's thread may drop user tensors.
  if (!worker_->on_worker_thread()) leftovers_.drop_all();
  auto work =
      c10::make_intrusive<PycommWork>(getRank(), type, title, std::move(outputs), worker_.get());
  std::function<void()> task = [this, work, body = std::move(body)]() mutable {
    std::exception_ptr error;
    try {
      // Ops run below autograd, as c10d's own backends do: copies into user tensors
      // must not be recorded.
      c10::impl::ExcludeDispatchKeyGuard no_autograd(
          c10::autograd_dispatch_keyset_with_ADInplaceOrView);
      body();
    } catch (...) {
      error = translate_current_exception();
    }
    // Callbacks run here, on this group's worker: an op they issue runs nested, at the
    // same point of the group's order on every rank.
    work->complete(error);
    leftovers_.park(std::move(work), std::move(body));
  };
  dispatch(*worker_, work, async_op, std::move(task));
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::finished_work(c10d::OpType type,
                                                                 const char* title,
                                                                 const at::Tensor& output) {
  auto work = c10::make_intrusive<PycommWork>(getRank(), type, title,
                                              std::vector<at::Tensor>{output}, worker_.get());
  work->complete(nullptr);
  return work;
}

// Any rank of the group, itself included (torch allows send to self), or any source.
void ProcessGroupPycomm::check_peer(int peer, const char* op) const {
  if (peer == pycomm::kAnySource) return;
  TORCH_CHECK_VALUE(peer >= 0 && peer < getSize(), "pycomm: ", op, " on rank ", getRank(),
                    ": peer ", peer, " is not a rank of this group of ", getSize());
}

// A p2p future that someone asked for may carry callbacks: they must not run on the
// engine thread (a callback that waits for another send/recv would stop the engine that
// must complete it), so such completions go to a thread of their own.
void ProcessGroupPycomm::complete_p2p(const c10::intrusive_ptr<PycommWork>& work,
                                      std::exception_ptr error, std::shared_ptr<void> staged) {
  auto complete = [this, work, error, staged]() mutable {
    work->complete(error);
    leftovers_.park(std::move(work), {}, std::move(staged));
  };
  if (!work->future_requested()) return complete();
  std::call_once(p2p_callbacks_once_,
                 [this] { p2p_callbacks_ = std::make_unique<pycomm::Worker>(); });
  if (!p2p_callbacks_) return complete();  // (released by close(): no thread is left)
  p2p_callbacks_->submit(std::move(complete));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::point_to_point(bool is_send, at::Tensor t,
                                                                  int peer, int tag) {
  const char* name = is_send ? "send" : "recv";
  pycomm::DType dtype = checked_dtype(t, name, getRank());
  check_peer(peer, name);
  check_open();
  leftovers_.drop_all();
  auto work = c10::make_intrusive<PycommWork>(
      getRank(), is_send ? c10d::OpType::SEND : c10d::OpType::RECV,
      is_send ? "pycomm:send" : "pycomm:recv", std::vector<at::Tensor>{t});
  // The engine reads/writes raw memory: stage non-contiguous tensors through a copy.
  auto staged = std::make_shared<Staged>(t);
  pycomm::P2PRequest req;
  req.is_send = is_send;
  req.peer = peer;
  req.tag = tag;
  req.dtype = dtype;
  req.count = staged->numel();
  req.data = staged->ptr();
  req.done = [this, work, staged, is_send](std::exception_ptr error, int source) mutable {
    if (!error && !is_send) {
      try {
        c10::impl::ExcludeDispatchKeyGuard no_autograd(
            c10::autograd_dispatch_keyset_with_ADInplaceOrView);
        staged->commit();
      } catch (...) {
        error = std::current_exception();
      }
    }
    work->set_source_rank(source);
    complete_p2p(work, error ? translate_exception(error) : nullptr, std::move(staged));
  };
  p2p_->submit(std::move(req));
  return work;
}

c10d::ReduceOp reduce_op_named(const std::string& op) {
  static const std::map<std::string, c10d::ReduceOp::RedOpType> ops = {
      {"sum", c10d::ReduceOp::SUM},
      {"avg", c10d::ReduceOp::AVG},
      {"prod", c10d::ReduceOp::PRODUCT},
      {"min", c10d::ReduceOp::MIN},
      {"max", c10d::ReduceOp::MAX}};
  auto it = ops.find(op);
  TORCH_CHECK_VALUE(it != ops.end(), "pycomm: unknown reduction op '", op,
                    "' (one of sum, avg, prod, min, max)");
  return c10d::ReduceOp(it->second);
}

// The same checks and body as allreduce(), run right here: no Work, no future, no
// closure on the heap. Ops queued before it keep their order: then it takes the queue.
// A CUDA tensor takes allreduce() (the CUDA path), never the shared-memory body.
void ProcessGroupPycomm::all_reduce_direct(at::Tensor& t, const c10d::ReduceOp& op) {
  if (t.device().is_cpu() && try_all_reduce_inline(t, op)) return;
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.asyncOp = false;
  std::vector<at::Tensor> tensors{t};
  allreduce(tensors, opts)->wait();
}

// all_reduce_direct's CPU body on the calling thread; false when the worker is busy with
// queued ops (then the op must queue behind them).
bool ProcessGroupPycomm::try_all_reduce_inline(at::Tensor& t, const c10d::ReduceOp& op) {
  pycomm::DType dt = checked_dtype(t, "all_reduce", getRank());
  ReduceSpec rs = reduce_spec(op, dt, "all_reduce", getRank());
  check_open();  // fail now if shut down
  if (!worker_->on_worker_thread()) leftovers_.drop_all();
  // Everything the body needs behind one pointer, so that the std::function holding it
  // stores it inline: no heap allocation on the synchronous path.
  struct Call {
    ProcessGroupPycomm* self;
    at::Tensor* t;
    pycomm::DType dt;
    const ReduceSpec* rs;
    std::exception_ptr error;  // the worker's run_inline expects a task that never throws
  } call{this, &t, dt, &rs, nullptr};
  auto body = [c = &call] {
    try {
      c10::impl::ExcludeDispatchKeyGuard no_autograd(
          c10::autograd_dispatch_keyset_with_ADInplaceOrView);
      c->self->reduce_in_place(*c->t, c->dt, *c->rs);
    } catch (...) {
      c->error = translate_current_exception();
    }
  };
  if (!worker_->run_inline(body)) return false;
  if (call.error) std::rethrow_exception(call.error);
  return true;
}

// The body of every CPU all_reduce: a contiguous copy when needed, PREMUL scaling, the
// core collective, the result written back.
void ProcessGroupPycomm::reduce_in_place(const at::Tensor& t, pycomm::DType dt,
                                         const ReduceSpec& rs) {
  Staged buf(t);
  rs.scale_owned(buf.get());
  all_reduce_flat(buf.ptr(), buf.numel(), dt, rs.op);
  buf.commit();
}

void ProcessGroupPycomm::all_reduce_flat(void* data, size_t count, pycomm::DType dt,
                                         pycomm::RedOp op) {
  pycomm::Communicator& own = comm();
  if (stripes_) return stripes_->all_reduce(data, count, dt, op);
  own.all_reduce(data, count, dt, op);
}

void ProcessGroupPycomm::all_reduce_now(at::Tensor& t, const std::string& op) {
  c10d::ReduceOp reduce = reduce_op_named(op);
  // Below autograd like the operator: bump the version as every in-place ATen op does.
  t.unsafeGetTensorImpl()->bump_version();
  all_reduce_direct(t, reduce);
}

void ProcessGroupPycomm::barrier_now() {
  c10d::BarrierOptions opts;
  opts.asyncOp = false;
  barrier(opts)->wait();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::send(std::vector<at::Tensor>& tensors, int dst,
                                                        int tag) {
  return point_to_point(true, single(tensors, "send", getRank()), dst, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::recv(std::vector<at::Tensor>& tensors, int src,
                                                        int tag) {
  return point_to_point(false, single(tensors, "recv", getRank()), src, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupPycomm::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                 int tag) {
  return point_to_point(false, single(tensors, "recv", getRank()), pycomm::kAnySource, tag);
}

}  // namespace pycomm_torch
