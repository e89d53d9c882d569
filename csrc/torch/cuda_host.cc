#include "cuda_host.h"

#include <pybind11/stl.h>

#include <string>

#include "cuda/host/ipc_handles.h"
#include "cuda/host/ring_plan.h"
#include "cuda/host/ring_sim.h"

#ifdef PYCOMM_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include "cuda/reduce_kernels.cuh"
#include "tensor_args.h"
#endif

namespace py = pybind11;

namespace pycomm_torch {
namespace {

pycomm::RingKind ring_kind(const std::string& name) {
  if (name == "all_reduce") return pycomm::RingKind::ALL_REDUCE;
  if (name == "reduce_scatter") return pycomm::RingKind::REDUCE_SCATTER;
  if (name == "all_gather") return pycomm::RingKind::ALL_GATHER;
  if (name == "broadcast") return pycomm::RingKind::BROADCAST;
  throw py::value_error("pycomm: no CUDA ring for '" + name +
                        "' (all_reduce, reduce_scatter, all_gather, broadcast)");
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
#ifdef PYCOMM_CUDA
  m.def("_cuda_copy_reduce", &cuda_copy_reduce, py::arg("out"), py::arg("srcs"),
        py::arg("op") = "sum", py::arg("scale") = 1.0);
#endif
}

}  // namespace pycomm_torch
