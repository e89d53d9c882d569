#include "torch/cuda/cuda_host.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cctype>
#include <memory>
#include <string>

#include "core/algorithms/ring_plan.h"
#include "cuda/host/ipc_handles.h"
#include "cuda/host/ring_sim.h"
#include "cuda/host/ring_sync.h"
#include "cuda/host/ring_walk.h"
#include "torch/backend/store_rendezvous.h"
#include "torch/backend/tensor_args.h"

#ifdef PYCOMM_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include "cuda/reduce_kernels.cuh"
#endif

namespace py = pybind11;

namespace pycomm_torch {
namespace {

pycomm::RingKind ring_kind(const std::string& name) {
  if (name == "all_reduce") return pycomm::RingKind::ALL_REDUCE;
  if (name == "reduce_scatter") return pycomm::RingKind::REDUCE_SCATTER;
  if (name == "all_gather") return pycomm::RingKind::ALL_GATHER;
  if (name == "broadcast") return pycomm::RingKind::BROADCAST;
  if (name == "reduce") return pycomm::RingKind::REDUCE;
  throw py::value_error("pycomm: no CUDA ring for '" + name +
                        "' (all_reduce, reduce_scatter, all_gather, broadcast, reduce)");
}

py::list plan_as_dicts(const std::string& kind, size_t count, int rank, int nranks, int root,
                       size_t chunk) {
  py::list out;
  for (const auto& s : pycomm::plan_ring(ring_kind(kind), count, rank, nranks, root, chunk)) {
    py::dict d;
    d["reads_local"] = s.reads_local;
    d["in_offset"] = s.in_offset;
    d["reads_prev"] = s.reads_prev;
    d["prev_step"] = s.prev_step;
    d["writes_window"] = s.writes_window;
    d["writes_out"] = s.writes_out;
    d["out_offset"] = s.out_offset;
    d["count"] = s.count;
    d["final"] = s.final;
    d["msg_offset"] = s.msg_offset;
    out.append(d);
  }
  return out;
}

py::dict blob_info(const pycomm::IpcWindowInfo& i) {
  auto bytes = [](const pycomm::IpcBlob& b) {
    return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
  };
  py::list ready, consumed;
  for (const auto& b : i.ready_events) ready.append(bytes(b));
  for (const auto& b : i.consumed_events) consumed.append(bytes(b));
  py::dict d;
  d["rank"] = i.rank;
  d["device"] = i.device;
  d["bus"] = i.pci_bus_id;
  d["slot_bytes"] = i.slot_bytes;
  d["slots"] = i.slots;
  d["window"] = bytes(i.window);
  d["ready"] = ready;
  d["consumed"] = consumed;
  return d;
}

pycomm::IpcBlob blob(const py::bytes& b) {
  std::string s = b;
  if (s.size() != pycomm::kIpcHandleBytes) {
    throw py::value_error("pycomm: an IPC handle has " + std::to_string(pycomm::kIpcHandleBytes) +
                          " bytes, got " + std::to_string(s.size()));
  }
  pycomm::IpcBlob out{};
  std::copy(s.begin(), s.end(), out.begin());
  return out;
}

pycomm::IpcWindowInfo info_from(const py::dict& d) {
  pycomm::IpcWindowInfo i;
  i.rank = d["rank"].cast<int>();
  i.device = d["device"].cast<int>();
  i.pci_bus_id = d["bus"].cast<std::string>();
  i.slot_bytes = d["slot_bytes"].cast<uint64_t>();
  i.slots = d["slots"].cast<uint32_t>();
  i.window = blob(d["window"].cast<py::bytes>());
  for (auto h : d["ready"]) i.ready_events.push_back(blob(h.cast<py::bytes>()));
  for (auto h : d["consumed"]) i.consumed_events.push_back(blob(h.cast<py::bytes>()));
  return i;
}

pycomm::DType dtype_named(const std::string& name) {
  for (auto t : {pycomm::DType::F32, pycomm::DType::F64, pycomm::DType::F16, pycomm::DType::BF16,
                 pycomm::DType::I8, pycomm::DType::U8, pycomm::DType::I32, pycomm::DType::I64,
                 pycomm::DType::BOOL}) {
    if (name == pycomm::dtype_name(t)) return t;
  }
  throw py::value_error("pycomm: no dtype '" + name + "'");
}

pycomm::RedOp redop_named(std::string name) {
  for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (name == "NONE") return pycomm::RedOp::NONE;
  for (auto op : {pycomm::RedOp::SUM, pycomm::RedOp::AVG, pycomm::RedOp::PROD, pycomm::RedOp::MIN,
                  pycomm::RedOp::MAX}) {
    if (name == pycomm::redop_name(op)) return op;
  }
  throw py::value_error("pycomm: no reduction '" + name + "'");
}

// Device work that does nothing: the ring's host protocol alone.
class NoDeviceIo : public pycomm::StepIo {
 public:
  void after_prev_wrote(int) override {}
  void after_next_read(int) override {}
  void run(const pycomm::RingStep&, int, int) override {}
  void wrote(int) override {}
  void read(int) override {}
};

// The CUDA ring's host synchronisation (ring_sync.h) over a c10d store, for tests that
// run it in real processes without a GPU: walks the same plans as the GPU path, with
// no device work.
class RingSyncProbe {
 public:
  RingSyncProbe(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, int slots,
                double timeout_s) {
    pycomm::RingSyncOptions opts;
    opts.slots = slots;
    opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
    StoreRendezvous rdv(store);
    sync_ = translated([&] { return std::make_unique<pycomm::RingSync>(rdv, rank, size, opts); });
  }

  // Numbers and publishes the call, then walks this rank's plan; returns the seq.
  uint64_t walk(const std::string& kind, size_t count, const std::string& dtype,
                const std::string& op, int root, size_t chunk_elems) {
    auto& sync = open();
    return translated([&] {
      auto plan =
          pycomm::plan_ring(ring_kind(kind), count, sync.rank(), sync.size(), root, chunk_elems);
      auto call = pycomm::begin_ring_call(sync, ring_kind(kind), dtype_named(dtype), count,
                                          redop_named(op), root);
      NoDeviceIo io;
      pycomm::walk_ring(sync, call, plan, io);
      return call.desc.seq;
    });
  }

  // Numbers and publishes the call, then waits for the predecessor to post `step`
  // without posting anything itself.
  uint64_t begin_and_wait(const std::string& kind, size_t count, const std::string& dtype,
                          const std::string& op, int root, int64_t step) {
    auto& sync = open();
    return translated([&] {
      auto call = pycomm::begin_ring_call(sync, ring_kind(kind), dtype_named(dtype), count,
                                          redop_named(op), root);
      if (step >= 0) sync.wait_posted(call, static_cast<uint64_t>(step));
      return call.desc.seq;
    });
  }

  void abort(const std::string& why) { open().abort(why); }
  int failed_by() { return open().failed_by(); }
  std::string abort_message() { return open().abort_message(); }
  bool peer_alive(int r) { return open().peer_alive(r); }

  // Teardown as IpcRing does it: drained, then wait (bounded) for both neighbours.
  bool drain(double timeout_s) {
    auto& sync = open();
    sync.drained();
    auto deadline = pycomm::WaitPolicy::deadline_after(
        pycomm::Clock::now(), std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
    return sync.size() == 1 ||
           (sync.wait_drained(sync.next(), deadline) && sync.wait_drained(sync.prev(), deadline));
  }
  void close() { sync_.reset(); }

 private:
  pycomm::RingSync& open() {
    if (!sync_) throw py::value_error("pycomm: this _RingSync was closed");
    return *sync_;
  }
  std::unique_ptr<pycomm::RingSync> sync_;
};

#ifdef PYCOMM_CUDA
// The copy-reduce kernel alone, on the current stream (for bench/gpu_check.sh).
void cuda_copy_reduce(at::Tensor& out, const std::vector<at::Tensor>& srcs, const std::string& op,
                      double scale) {
  TORCH_CHECK_VALUE(out.is_cuda() && out.is_contiguous(), "out must be a contiguous CUDA tensor");
  pycomm::DType t = dense_dtype(out, "_cuda_copy_reduce", 0);
  TORCH_CHECK_VALUE(!srcs.empty() && srcs.size() <= pycomm::cuda::kMaxSources,
                    "_cuda_copy_reduce takes 1 to ", pycomm::cuda::kMaxSources, " sources, got ",
                    srcs.size());
  std::vector<const void*> ptrs;
  for (const auto& s : srcs) {
    TORCH_CHECK_VALUE(s.is_cuda() && s.is_contiguous() && s.numel() == out.numel() &&
                          s.scalar_type() == out.scalar_type(),
                      "every source must be a contiguous CUDA tensor like out");
    ptrs.push_back(s.data_ptr());
  }
  pycomm::RedOp r = op == "max" ? pycomm::RedOp::MAX : pycomm::RedOp::SUM;
  TORCH_CHECK_VALUE(pycomm::cuda::reduce_supported(t, r), "_cuda_copy_reduce: no kernel for ",
                    pycomm::redop_name(r), " on ", pycomm::dtype_name(t));
  void* dst = out.data_ptr();
  auto stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  cudaError_t e =
      pycomm::cuda::copy_reduce(t, r, &dst, 1, ptrs.data(), static_cast<int>(ptrs.size()),
                                out.numel(), static_cast<float>(scale), stream);
  TORCH_CHECK(e == cudaSuccess, "copy_reduce: ", cudaGetErrorString(e));
}
#endif

}  // namespace

void register_cuda_host(py::module& m) {
  m.def("_ring_plan", &plan_as_dicts, py::arg("kind"), py::arg("count"), py::arg("rank"),
        py::arg("nranks"), py::arg("root") = 0, py::arg("chunk_elems"),
        "The steps one rank of the CUDA-IPC ring walks (for tests and docs).");
  m.def(
      "_ring_simulate",
      [](const std::string& kind, const std::vector<std::vector<double>>& inputs, size_t count,
         int root, size_t chunk, int slots, uint64_t seed) {
        auto r = pycomm::simulate_ring(ring_kind(kind), inputs, count, root, chunk, slots, seed);
        return py::make_tuple(r.outputs, r.steps, r.max_waits);
      },
      py::arg("kind"), py::arg("inputs"), py::arg("count"), py::arg("root"), py::arg("chunk_elems"),
      py::arg("slots"), py::arg("seed"),
      "Walks every rank's ring plan on the host under the GPU executor's ordering rules.");
  m.def("_ring_chunk_bytes", &pycomm::ring_chunk_bytes, py::arg("message_bytes"), py::arg("nranks"),
        py::arg("min_chunk"), py::arg("max_chunk"), py::arg("min_rounds"));
  m.def(
      "_ipc_encode", [](const py::dict& d) { return pycomm::encode_ipc_info(info_from(d)); },
      py::arg("info"));
  m.def(
      "_ipc_decode",
      [](const std::string& text, int from_rank) {
        return blob_info(pycomm::decode_ipc_info(text, from_rank));
      },
      py::arg("text"), py::arg("from_rank"));
  m.def(
      "_ipc_check_peer",
      [](const py::dict& mine, const py::dict& peer) {
        pycomm::check_ipc_peer(info_from(mine), info_from(peer));
      },
      py::arg("mine"), py::arg("peer"));
  using gil_free = py::call_guard<py::gil_scoped_release>;
  py::class_<RingSyncProbe>(m, "_RingSync",
                            "The CUDA ring's host synchronisation without a GPU (for tests).")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, int, double>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("slots") = 4,
           py::arg("timeout_s") = 60.0, gil_free())
      .def("walk", &RingSyncProbe::walk, py::arg("kind"), py::arg("count"),
           py::arg("dtype") = "float32", py::arg("op") = "sum", py::arg("root") = 0,
           py::arg("chunk_elems") = 1, gil_free())
      .def("begin_and_wait", &RingSyncProbe::begin_and_wait, py::arg("kind"), py::arg("count"),
           py::arg("dtype") = "float32", py::arg("op") = "sum", py::arg("root") = 0,
           py::arg("step") = -1, gil_free())
      .def("abort", &RingSyncProbe::abort, py::arg("why"), gil_free())
      .def("failed_by", &RingSyncProbe::failed_by)
      .def("abort_message", &RingSyncProbe::abort_message)
      .def("peer_alive", &RingSyncProbe::peer_alive, py::arg("rank"))
      .def("drain", &RingSyncProbe::drain, py::arg("timeout_s"), gil_free())
      .def("close", &RingSyncProbe::close, gil_free());
#ifdef PYCOMM_CUDA
  m.def("_cuda_copy_reduce", &cuda_copy_reduce, py::arg("out"), py::arg("srcs"),
        py::arg("op") = "sum", py::arg("scale") = 1.0);
#endif
}

}  // namespace pycomm_torch
