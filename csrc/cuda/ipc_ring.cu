#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>

#include "core/runtime/config.h"
#include "core/runtime/errors.h"
#include "core/runtime/log.h"
#include "cuda/ipc_ring.cuh"
#include "cuda/reduce_kernels.cuh"

namespace pycomm {
namespace cuda {

// One cache line per rank: `posted` is written by its owner, `read_by_next` by its
// successor, so no line is written by two ranks.
struct alignas(64) RankLine {
  std::atomic<uint64_t> posted;        // the owner's steps < posted are enqueued
  std::atomic<uint64_t> read_by_next;  // the successor has enqueued its reads of steps <
};
struct HostCounters {
  std::atomic<uint32_t> aborted;
  char why[252];
  RankLine ranks[1];  // `size` of them
};

namespace {

size_t counters_bytes(int size) { return sizeof(HostCounters) + size * sizeof(RankLine); }

std::string key(int rank, const char* what) {
  return "pycomm/cuda/" + std::string(what) + "/" + std::to_string(rank);
}

float scale_for(RedOp op, int size) { return op == RedOp::AVG ? 1.0f / size : 1.0f; }

}  // namespace

RingOptions RingOptions::from_env(std::chrono::milliseconds timeout) {
  Config c = Config::from_env();  // validates PYCOMM_CUDA_* and PYCOMM_DEBUG
  RingOptions o;
  o.slot_bytes = c.cuda_chunk_bytes;
  o.slots = static_cast<int>(c.cuda_slots);
  o.log = c.log;
  o.timeout = timeout;
  return o;
}

void IpcRing::check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::string msg = "pycomm: rank " + std::to_string(rank_) + " (cuda:" + std::to_string(device_) +
                    ") " + what + " failed: " + cudaGetErrorString(e) +
                    (current_op_.empty() ? "" : " during " + current_op_);
  if (counters_) abort(msg);
  throw CommError(msg);
}

IpcRing::IpcRing(Rendezvous& rdv, int rank, int size, int device, RingOptions opts)
    : rank_(rank),
      size_(size),
      prev_((rank + size - 1) % size),
      next_((rank + 1) % size),
      device_(device),
      opts_(opts),
      last_written_(opts.slots, -1) {
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
  exchange(rdv);
}

// Rank 0 creates the counters' segment; everyone publishes its window and events and maps
// its neighbours'. The segment's name is removed once every rank has it mapped.
void IpcRing::exchange(Rendezvous& rdv) {
  if (rank_ == 0) {
    shm_ = ShmSegment::create(counters_bytes(size_), counters_bytes(size_),
                              "the CUDA ring's counters");
    rdv.set(key(0, "counters"), shm_.name());
  } else {
    shm_ = ShmSegment::open(rdv.get(key(0, "counters")), counters_bytes(size_));
  }
  counters_ = static_cast<HostCounters*>(shm_.data());
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
  if (size_ > 1) {
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
  rdv.set(key(rank_, "mapped"), "1");
  if (rank_ == 0) {
    for (int r = 1; r < size_; ++r) rdv.get(key(r, "mapped"));
    shm_.unlink();
  }
}

IpcRing::~IpcRing() {
  // Best effort: a destructor must not throw, and the device may be gone at exit.
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  if (prev_window_) cudaIpcCloseMemHandle(const_cast<char*>(prev_window_));
  for (auto e : prev_ready_) cudaEventDestroy(e);
  for (auto e : next_consumed_) cudaEventDestroy(e);
  for (auto e : ready_) cudaEventDestroy(e);
  for (auto e : consumed_) cudaEventDestroy(e);
  if (window_) cudaFree(window_);
}

void IpcRing::abort(const std::string& why) {
  if (!counters_) return;
  uint32_t expected = 0;
  if (counters_->aborted.compare_exchange_strong(expected, 1)) {
    size_t n = std::min(why.size(), sizeof(counters_->why) - 1);
    std::copy_n(why.data(), n, counters_->why);
    counters_->why[n] = '\0';
  }
}

// Polls, then yields the core, then sleeps 50 us between polls (ranks may outnumber
// cores); checks the abort flag and the deadline.
template <typename Ready>
void IpcRing::wait_host(Ready ready, int peer, const char* what, uint64_t step) {
  if (ready()) return;
  auto start = std::chrono::steady_clock::now();
  for (uint64_t spins = 0;; ++spins) {
    if (ready()) return;
    if (counters_->aborted.load(std::memory_order_acquire)) {
      throw CommError("pycomm: rank " + std::to_string(rank_) + " stops " + current_op_ +
                      ": the job was aborted (" + std::string(counters_->why) + ")");
    }
    auto waited = std::chrono::steady_clock::now() - start;
    if (waited > opts_.timeout) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(waited).count();
      std::string msg = "pycomm: timeout after " + std::to_string(ms) + " ms in " + current_op_ +
                        " (CUDA ring): rank " + std::to_string(rank_) + " waited for rank " +
                        std::to_string(peer) + " to " + what + " step " + std::to_string(step) +
                        "; that rank is missing, slow, or called another op";
      abort(msg);
      throw CommError(msg);
    }
    if (spins < 2000) continue;
    if (spins < 4000) {
      sched_yield();
      continue;
    }
    timespec ts{0, 50000};
    nanosleep(&ts, nullptr);
  }
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
  Logger log(opts_.log, rank_, size_);
  if (log.enabled(LogLevel::INFO)) {
    log.log(LogLevel::INFO, current_op_ + ": CUDA ring, " + std::to_string(plan.size()) +
                                " steps of <= " + std::to_string(chunk_elems * esize) + " B, " +
                                std::to_string(opts_.slots) + " slots");
  }
  const float scale = scale_for(op, size_);
  const uint64_t base = steps_;
  const int slots = opts_.slots;
  HostCounters& c = *counters_;
  for (size_t i = 0; i < plan.size(); ++i) {
    const RingStep& s = plan[i];
    const uint64_t id = base + i;
    const void* srcs[2];
    void* dsts[2];
    int nsrc = 0, ndst = 0;
    if (s.reads_local) srcs[nsrc++] = static_cast<const char*>(in) + s.in_offset * esize;
    uint64_t prev_id = 0;
    if (s.reads_prev) {
      prev_id = base + static_cast<uint64_t>(s.prev_step);
      wait_host([&] { return c.ranks[prev_].posted.load(std::memory_order_acquire) > prev_id; },
                prev_, "post", prev_id);
      check(cudaStreamWaitEvent(stream, prev_ready_[prev_id % slots], 0), "cudaStreamWaitEvent");
      srcs[nsrc++] = prev_window_ + (prev_id % slots) * opts_.slot_bytes;
    }
    const int slot = static_cast<int>(id % slots);
    if (s.writes_window) {
      const int64_t held = last_written_[slot];
      if (held >= 0) {
        wait_host(
            [&] {
              return c.ranks[rank_].read_by_next.load(std::memory_order_acquire) >
                     static_cast<uint64_t>(held);
            },
            next_, "read", static_cast<uint64_t>(held));
        check(cudaStreamWaitEvent(stream, next_consumed_[slot], 0), "cudaStreamWaitEvent");
      }
      dsts[ndst++] = window_ + slot * opts_.slot_bytes;
    }
    if (s.writes_out) dsts[ndst++] = static_cast<char*>(out) + s.out_offset * esize;
    if (s.count > 0 && ndst > 0) {
      check(copy_reduce(t, op, dsts, ndst, srcs, nsrc, s.count, s.final ? scale : 1.0f, stream),
            "the copy-reduce kernel launch");
    }
    if (s.writes_window) {
      check(cudaEventRecord(ready_[slot], stream), "cudaEventRecord");
      last_written_[slot] = static_cast<int64_t>(id);
    }
    if (s.reads_prev) {
      check(cudaEventRecord(consumed_[prev_id % slots], stream), "cudaEventRecord");
      c.ranks[prev_].read_by_next.store(prev_id + 1, std::memory_order_release);
    }
    c.ranks[rank_].posted.store(id + 1, std::memory_order_release);
  }
  steps_ = base + plan.size();
}

void IpcRing::all_reduce(void* out, const void* in, size_t count, DType t, RedOp op,
                         cudaStream_t stream) {
  current_op_ = std::string("all_reduce ") + dtype_name(t) + "[" + std::to_string(count) + "] " +
                redop_name(op);
  run(RingKind::ALL_REDUCE, count, t, op, 0, out, in, stream);
}

void IpcRing::reduce_scatter(void* out, const void* in, size_t count, DType t, RedOp op,
                             cudaStream_t stream) {
  current_op_ = std::string("reduce_scatter ") + dtype_name(t) + "[" + std::to_string(count) +
                "] " + redop_name(op);
  run(RingKind::REDUCE_SCATTER, count, t, op, 0, out, in, stream);
}

void IpcRing::all_gather(void* out, const void* in, size_t count, DType t, cudaStream_t stream) {
  current_op_ = std::string("all_gather ") + dtype_name(t) + "[" + std::to_string(count) + "]";
  run(RingKind::ALL_GATHER, count, t, RedOp::NONE, 0, out, in, stream);
}

void IpcRing::broadcast(void* buf, size_t count, DType t, int root, cudaStream_t stream) {
  current_op_ = std::string("broadcast ") + dtype_name(t) + "[" + std::to_string(count) +
                "] root " + std::to_string(root);
  run(RingKind::BROADCAST, count, t, RedOp::NONE, root, buf, buf, stream);
}

}  // namespace cuda
}  // namespace pycomm
