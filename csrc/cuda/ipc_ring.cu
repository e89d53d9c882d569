#include <algorithm>

#include "core/base/config.h"
#include "core/base/errors.h"
#include "core/base/log.h"
#include "cuda/host/ring_walk.h"
#include "cuda/ipc_ring.cuh"
#include "cuda/reduce_kernels.cuh"

namespace pycomm {
namespace cuda {
namespace {

std::string key(int rank, const char* what) {
  return "pycomm/cuda/" + std::string(what) + "/" + std::to_string(rank);
}

float scale_for(RedOp op, int size) { return op == RedOp::AVG ? 1.0f / size : 1.0f; }

// How long teardown waits for the neighbours to be done with this rank's window: ranks
// usually destroy their groups together; one that is much later costs a leak, not a hang.
constexpr auto kPeerDrainLimit = std::chrono::seconds(30);

}  // namespace

// The device side of a ring step on one stream: event waits and records, and the
// copy-reduce kernel between the local buffers and the two windows.
class CudaStepIo : public StepIo {
 public:
  CudaStepIo(IpcRing& ring, cudaStream_t stream, DType t, RedOp op, float scale, void* out,
             const void* in)
      : ring_(ring),
        stream_(stream),
        t_(t),
        op_(op),
        scale_(scale),
        esize_(dtype_size(t)),
        out_(static_cast<char*>(out)),
        in_(static_cast<const char*>(in)) {}

  void after_prev_wrote(int slot) override {
    ring_.check(cudaStreamWaitEvent(stream_, ring_.prev_ready_[slot], 0), "cudaStreamWaitEvent");
  }
  void after_next_read(int slot) override {
    ring_.check(cudaStreamWaitEvent(stream_, ring_.next_consumed_[slot], 0), "cudaStreamWaitEvent");
  }
  void run(const RingStep& s, int slot, int prev_slot) override {
    const size_t slot_bytes = ring_.opts_.slot_bytes;
    const void* srcs[2];
    void* dsts[2];
    int nsrc = 0, ndst = 0;
    if (s.reads_local) srcs[nsrc++] = in_ + s.in_offset * esize_;
    if (s.reads_prev) srcs[nsrc++] = ring_.prev_window_ + prev_slot * slot_bytes;
    if (s.writes_window) dsts[ndst++] = ring_.window_ + slot * slot_bytes;
    if (s.writes_out) dsts[ndst++] = out_ + s.out_offset * esize_;
    if (s.count == 0 || ndst == 0) return;
    ring_.check(
        copy_reduce(t_, op_, dsts, ndst, srcs, nsrc, s.count, s.final ? scale_ : 1.0f, stream_),
        "the copy-reduce kernel launch");
  }
  void wrote(int slot) override {
    ring_.check(cudaEventRecord(ring_.ready_[slot], stream_), "cudaEventRecord");
  }
  void read(int prev_slot) override {
    ring_.check(cudaEventRecord(ring_.consumed_[prev_slot], stream_), "cudaEventRecord");
  }

 private:
  IpcRing& ring_;
  cudaStream_t stream_;
  DType t_;
  RedOp op_;
  float scale_;
  size_t esize_;
  char* out_;
  const char* in_;
};

RingOptions RingOptions::from_env(std::chrono::milliseconds timeout) {
  Config c = Config::from_env();  // validates PYCOMM_CUDA_* and PYCOMM_DEBUG
  RingOptions o;
  o.slot_bytes = c.cuda_chunk_bytes;
  o.slots = static_cast<int>(c.cuda_slots);
  o.log = c.log;
  o.wait = WaitPolicy(c.spin_us, c.yield_us, c.wait_slice_us);
  o.timeout = timeout;
  return o;
}

void IpcRing::check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::string msg = "pycomm: rank " + std::to_string(rank_) + " (cuda:" + std::to_string(device_) +
                    ") " + what + " failed: " + cudaGetErrorString(e) +
                    (current_op_.empty() ? "" : " during " + current_op_);
  if (sync_) sync_->abort(msg);
  throw CommError(msg);
}

IpcRing::IpcRing(Rendezvous& rdv, int rank, int size, int device, RingOptions opts)
    : rank_(rank),
      size_(size),
      prev_((rank + size - 1) % size),
      next_((rank + 1) % size),
      device_(device),
      opts_(opts) {
  check(cudaSetDevice(device_), "cudaSetDevice");
  check(cudaMalloc(&window_, opts_.slot_bytes * opts_.slots), "cudaMalloc of the window");
  for (int s = 0; s < opts_.slots; ++s) {
    cudaEvent_t r, c;
    unsigned flags = cudaEventDisableTiming | cudaEventInterprocess;
    check(cudaEventCreateWithFlags(&r, flags), "cudaEventCreateWithFlags");
    check(cudaEventCreateWithFlags(&c, flags), "cudaEventCreateWithFlags");
    ready_.push_back(r);
    consumed_.push_back(c);
  }
  RingSyncOptions so;
  so.slots = opts_.slots;
  so.timeout = opts_.timeout;
  so.wait = opts_.wait;
  sync_ = std::make_unique<RingSync>(rdv, rank_, size_, so);
  exchange(rdv);
}

// Everyone publishes its window and events and maps its neighbours'.
void IpcRing::exchange(Rendezvous& rdv) {
  IpcWindowInfo mine;
  mine.rank = rank_;
  mine.device = device_;
  char bus[32] = {0};
  check(cudaDeviceGetPCIBusId(bus, sizeof(bus), device_), "cudaDeviceGetPCIBusId");
  mine.pci_bus_id = bus;
  mine.slot_bytes = opts_.slot_bytes;
  mine.slots = static_cast<uint32_t>(opts_.slots);
  cudaIpcMemHandle_t mem;
  check(cudaIpcGetMemHandle(&mem, window_), "cudaIpcGetMemHandle");
  std::copy_n(reinterpret_cast<const uint8_t*>(&mem), kIpcHandleBytes, mine.window.begin());
  for (int s = 0; s < opts_.slots; ++s) {
    cudaIpcEventHandle_t r, c;
    check(cudaIpcGetEventHandle(&r, ready_[s]), "cudaIpcGetEventHandle");
    check(cudaIpcGetEventHandle(&c, consumed_[s]), "cudaIpcGetEventHandle");
    IpcBlob rb{}, cb{};
    std::copy_n(reinterpret_cast<const uint8_t*>(&r), kIpcHandleBytes, rb.begin());
    std::copy_n(reinterpret_cast<const uint8_t*>(&c), kIpcHandleBytes, cb.begin());
    mine.ready_events.push_back(rb);
    mine.consumed_events.push_back(cb);
  }
  rdv.set(key(rank_, "window"), encode_ipc_info(mine));
  if (size_ == 1) return;
  IpcWindowInfo prev = decode_ipc_info(rdv.get(key(prev_, "window")), prev_);
  IpcWindowInfo next = decode_ipc_info(rdv.get(key(next_, "window")), next_);
  check_ipc_peer(mine, prev);
  check_ipc_peer(mine, next);
  cudaIpcMemHandle_t pm;
  std::copy_n(prev.window.begin(), kIpcHandleBytes, reinterpret_cast<uint8_t*>(&pm));
  void* mapped = nullptr;
  check(cudaIpcOpenMemHandle(&mapped, pm, cudaIpcMemLazyEnablePeerAccess),
        "cudaIpcOpenMemHandle of the predecessor's window");
  prev_window_ = static_cast<const char*>(mapped);
  for (int s = 0; s < opts_.slots; ++s) {
    cudaIpcEventHandle_t h;
    cudaEvent_t e;
    std::copy_n(prev.ready_events[s].begin(), kIpcHandleBytes, reinterpret_cast<uint8_t*>(&h));
    check(cudaIpcOpenEventHandle(&e, h), "cudaIpcOpenEventHandle");
    prev_ready_.push_back(e);
    std::copy_n(next.consumed_events[s].begin(), kIpcHandleBytes, reinterpret_cast<uint8_t*>(&h));
    check(cudaIpcOpenEventHandle(&e, h), "cudaIpcOpenEventHandle");
    next_consumed_.push_back(e);
  }
}

// ---------------------------------------------------------------------------- teardown

// No cudaDeviceSynchronize: a kernel ordered after a dead peer's event may never run.
// This ring's own work is polled through its events, with a bound; what may still be in
// use (by this GPU's queue or by a neighbour's) is leaked rather than freed under it.
IpcRing::~IpcRing() {
  cudaSetDevice(device_);
  if (!release_when_unused()) {
    Logger(LogSettings{}, rank_)
        .log(LogLevel::WARN, Subsys::COLL,
             "the CUDA ring's window and events stay allocated: " +
                 std::string(sync_ && sync_->hurry() ? "the job failed or a peer died"
                                                     : "the GPU or a peer was still using them") +
                 " at teardown");
  }
  sync_.reset();  // leaves the counters (the neighbours see this rank gone)
}

// True if everything was released.
bool IpcRing::release_when_unused() {
  if (!sync_) return false;  // the constructor failed before the counters: nothing is shared
  const auto start = Clock::now();
  const auto own = WaitPolicy::deadline_after(start, opts_.timeout);
  if (!sync_->settle([&] { return own_work_done(); }, own)) return false;
  for (auto& [stream, done] : in_flight_) cudaEventDestroy(done);
  in_flight_.clear();
  // Nothing of this rank reads the predecessor's window or waits on its events any more.
  if (prev_window_) cudaIpcCloseMemHandle(const_cast<char*>(prev_window_));
  for (auto e : prev_ready_) cudaEventDestroy(e);
  for (auto e : next_consumed_) cudaEventDestroy(e);
  prev_window_ = nullptr;
  prev_ready_.clear();
  next_consumed_.clear();
  sync_->drained();
  // The neighbours read this window and wait on these events until they are drained.
  const auto peers = WaitPolicy::deadline_after(
      start, std::min<std::chrono::milliseconds>(opts_.timeout, kPeerDrainLimit));
  if (size_ > 1 && !(sync_->wait_drained(next_, peers) && sync_->wait_drained(prev_, peers))) {
    return false;
  }
  for (auto e : ready_) cudaEventDestroy(e);
  for (auto e : consumed_) cudaEventDestroy(e);
  ready_.clear();
  consumed_.clear();
  if (window_) cudaFree(window_);
  window_ = nullptr;
  return true;
}

// An event that reports an error counts as done: the context failed and runs nothing.
bool IpcRing::own_work_done() {
  if (untracked_) return false;
  for (auto& [stream, done] : in_flight_) {
    if (cudaEventQuery(done) == cudaErrorNotReady) return false;
  }
  return true;
}

// Keeps one event per stream, re-recorded after each op (also one that failed half way:
// what it enqueued may still run): the stream's order makes its completion cover every
// earlier op there. Streams whose work is done are forgotten. Does not throw: if the
// event cannot be recorded, teardown treats this rank's work as never done.
void IpcRing::mark_in_flight(cudaStream_t stream) noexcept {
  auto finished = [&](std::pair<cudaStream_t, cudaEvent_t>& p) {
    if (p.first == stream || cudaEventQuery(p.second) == cudaErrorNotReady) return false;
    cudaEventDestroy(p.second);
    return true;
  };
  in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(), finished),
                   in_flight_.end());
  auto it = std::find_if(in_flight_.begin(), in_flight_.end(),
                         [&](const auto& p) { return p.first == stream; });
  if (it == in_flight_.end()) {
    cudaEvent_t e;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      untracked_ = true;
      return;
    }
    it = in_flight_.insert(in_flight_.end(), {stream, e});
  }
  if (cudaEventRecord(it->second, stream) != cudaSuccess) untracked_ = true;
}

// ------------------------------------------------------------------------------- ops

void IpcRing::set_timeout(std::chrono::milliseconds t) {
  opts_.timeout = t;
  if (sync_) sync_->set_timeout(t);
}

void IpcRing::abort(const std::string& why) {
  if (sync_) sync_->abort(why);
}

void IpcRing::run(RingKind kind, size_t count, DType t, RedOp op, int root, void* out,
                  const void* in, cudaStream_t stream) {
  const size_t esize = dtype_size(t);
  size_t message = count * esize *
                   (kind == RingKind::ALL_GATHER || kind == RingKind::REDUCE_SCATTER ? size_ : 1);
  // At least 4 rounds per part to pipeline, chunks of 256 KiB or more (never above a slot).
  size_t chunk_bytes = ring_chunk_bytes(message, size_, 256 << 10, opts_.slot_bytes, 4);
  size_t chunk_elems = std::max<size_t>(1, chunk_bytes / esize);
  std::vector<RingStep> plan = plan_ring(kind, count, rank_, size_, root, chunk_elems);
  OpCall call = begin_ring_call(*sync_, kind, t, count, op, root);
  current_op_ = where(call, rank_);
  Logger log(opts_.log, rank_);
  if (log.enabled(LogLevel::TRACE, Subsys::COLL)) {
    log.log(LogLevel::TRACE, Subsys::COLL,
            current_op_ + ": CUDA ring, " + std::to_string(plan.size()) +
                " steps of <= " + std::to_string(chunk_elems * esize) + " B, " +
                std::to_string(opts_.slots) + " slots");
  }
  CudaStepIo io(*this, stream, t, op, scale_for(op, size_), out, in);
  try {
    walk_ring(*sync_, call, plan, io);
  } catch (...) {
    mark_in_flight(stream);
    throw;
  }
  mark_in_flight(stream);
  current_op_.clear();
}

void IpcRing::all_reduce(void* out, const void* in, size_t count, DType t, RedOp op,
                         cudaStream_t stream) {
  run(RingKind::ALL_REDUCE, count, t, op, 0, out, in, stream);
}

void IpcRing::reduce_scatter(void* out, const void* in, size_t count, DType t, RedOp op,
                             cudaStream_t stream) {
  run(RingKind::REDUCE_SCATTER, count, t, op, 0, out, in, stream);
}

void IpcRing::all_gather(void* out, const void* in, size_t count, DType t, cudaStream_t stream) {
  run(RingKind::ALL_GATHER, count, t, RedOp::NONE, 0, out, in, stream);
}

void IpcRing::broadcast(void* buf, size_t count, DType t, int root, cudaStream_t stream) {
  run(RingKind::BROADCAST, count, t, RedOp::NONE, root, buf, buf, stream);
}

}  // namespace cuda
}  // namespace pycomm
