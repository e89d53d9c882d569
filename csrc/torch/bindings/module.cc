// pycomm._C: the backend class for torch.distributed, and a few core facts for Python.
#include <sys/stat.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <chrono>
#include <map>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "core/base/config.h"
#include "core/communicator/core_probe.h"
#include "core/communicator/faults.h"
#include "core/communicator/fork_guard.h"
#include "core/communicator/worker.h"
#include "core/kernels/f16c.h"
#include "core/kernels/reduce.h"
#include "core/memory/arena.h"
#include "core/transport/shm_segment.h"
#include "torch/backend/backend.h"
#include "torch/backend/tensor_args.h"
#include "torch/bindings/storage_binding.h"
#include "torch/cuda/cuda_host.h"
#include "torch/fused/fused.h"
#include "torch/islands/islands.h"

namespace py = pybind11;

namespace {

at::Tensor arena_empty(const std::vector<int64_t>& sizes, c10::ScalarType dtype) {
  uint64_t bytes = c10::elementSize(dtype);
  for (int64_t s : sizes) {
    TORCH_CHECK_VALUE(s >= 0, "pycomm.empty: negative dimension ", s);
    // Checked before anything is allocated: an overflowing size would otherwise
    // allocate a small block that from_blob then refuses (and it would leak).
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(bytes, static_cast<uint64_t>(s), &bytes),
                      "pycomm.empty: shape ", c10::IntArrayRef(sizes), " of ", dtype,
                      " is more bytes than an address space holds");
  }
  void* p = pycomm_torch::translated([&] { return pycomm::Arena::instance().allocate(bytes); });
  return at::from_blob(
      p, sizes, [](void* ptr) { pycomm::Arena::instance().release(ptr); },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

py::dict arena_stats() {
  pycomm::ArenaStats st = pycomm::Arena::instance().stats();
  py::dict d;
  d["reserved"] = st.reserved;
  d["live"] = st.live;
  d["peak"] = st.peak;
  d["slabs"] = st.slabs;
  d["allocations"] = st.allocations;
  d["largest_free"] = st.largest_free;
  d["trimmed"] = st.trimmed;
  return d;
}

pycomm::RedOp parse_op(const std::string& op) {
  static const std::map<std::string, pycomm::RedOp> ops = {
      {"sum", pycomm::RedOp::SUM},  {"prod", pycomm::RedOp::PROD}, {"min", pycomm::RedOp::MIN},
      {"max", pycomm::RedOp::MAX},  {"band", pycomm::RedOp::BAND}, {"bor", pycomm::RedOp::BOR},
      {"bxor", pycomm::RedOp::BXOR}};
  auto it = ops.find(op);
  TORCH_CHECK_VALUE(it != ops.end(), "unknown op ", op);
  return it->second;
}

// dst = a op b with the core's kernels, for micro-benchmarks and kernel tests.
void reduce_into(at::Tensor dst, const at::Tensor& a, const at::Tensor& b, const std::string& op) {
  pycomm::RedOp rop = parse_op(op);
  TORCH_CHECK_VALUE(dst.is_contiguous() && a.is_contiguous() && b.is_contiguous() &&
                        dst.numel() == a.numel() && a.numel() == b.numel() &&
                        dst.scalar_type() == a.scalar_type() && a.scalar_type() == b.scalar_type(),
                    "reduce_into: three contiguous tensors of one dtype and size");
  pycomm::DType dt = pycomm_torch::checked_dtype(dst, "reduce_into", 0);
  pycomm::reduce_pair(dt, pycomm::kernel_op(dt, rop), dst.data_ptr(), a.data_ptr(), b.data_ptr(),
                      static_cast<size_t>(dst.numel()));
}

// Every dst = scale * (op over srcs), in one pass (reduce_copy), for kernel tests and
// benchmarks. The scale is for floating dtypes (AVG's 1/world); 1.0 is none.
void reduce_copy_into(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs,
                      const std::string& op, double scale) {
  TORCH_CHECK_VALUE(!dsts.empty() && !srcs.empty(), "reduce_copy: need a source and a destination");
  const at::Tensor& first = srcs[0];
  std::vector<void*> dp;
  std::vector<const void*> sp;
  for (const auto* list : {&dsts, &srcs}) {
    for (const at::Tensor& x : *list) {
      TORCH_CHECK_VALUE(
          x.is_contiguous() && x.numel() == first.numel() && x.scalar_type() == first.scalar_type(),
          "reduce_copy: contiguous tensors of one dtype and size");
    }
  }
  for (const at::Tensor& x : dsts) dp.push_back(x.data_ptr());
  for (const at::Tensor& x : srcs) sp.push_back(x.data_ptr());
  pycomm::DType dt = pycomm_torch::checked_dtype(first, "reduce_copy", 0);
  pycomm::RedOp rop = parse_op(op);
  pycomm::check_reduction(dt, rop);
  pycomm::reduce_copy(dt, pycomm::kernel_op(dt, rop), dp.data(), static_cast<int>(dp.size()),
                      sp.data(), static_cast<int>(sp.size()), static_cast<size_t>(first.numel()),
                      scale);
}

bool in_arena(const at::Tensor& t) {
  pycomm::ArenaLocation loc;
  size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  return t.device().is_cpu() && pycomm::Arena::instance().locate(t.data_ptr(), bytes, &loc);
}

c10::intrusive_ptr<pycomm_torch::ProcessGroupPycomm> create(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s) {
  auto ms = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  return c10::make_intrusive<pycomm_torch::ProcessGroupPycomm>(store, rank, size, ms);
}

}  // namespace

void register_islands(py::module_& m);
void register_env_info(py::module_& m);         // env_info.cc
void register_arena_allocator(py::module_& m);  // arena_allocator.cc
namespace pycomm_torch {
void register_work(py::module_& m);  // work_binding.cc
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pycomm::install_fork_guard();  // before any group or arena exists (fork_guard.h)
  m.doc() = "pycomm's C++ core: the shared-memory torch.distributed backend";
  // Backend is registered by torch; deriving from it lets torch attach ours to a ProcessGroup.
  py::module_::import("torch.distributed");
  py::class_<pycomm_torch::ProcessGroupPycomm, c10d::Backend,
             c10::intrusive_ptr<pycomm_torch::ProcessGroupPycomm>>(m, "ProcessGroupPycomm")
      .def(py::init(&create), py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "Joins the group's shared-memory segment (collective: every rank must call it).")
      .def("all_reduce_now", &pycomm_torch::ProcessGroupPycomm::all_reduce_now, py::arg("tensor"),
           py::arg("op") = "sum", py::call_guard<py::gil_scoped_release>(),
           "Blocking all_reduce on the calling thread, bypassing torch's dispatcher.")
      .def("barrier_now", &pycomm_torch::ProcessGroupPycomm::barrier_now,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("segment_bytes", &pycomm_torch::ProcessGroupPycomm::segment_bytes);
  m.def(
      "all_reduce_eager",
      [](at::Tensor& tensor, const std::string& op,
         const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
        // A CPU tensor on a pycomm group goes straight to the backend, which refuses by
        // itself once its group is destroyed (check_open): the registry lookup that
        // proves another backend's group is live (a global lock and a map) is not paid.
        if (tensor.device().is_cpu()) {
          auto backend = group->getBackend(c10::DeviceType::CPU);
          if (auto* ours = dynamic_cast<pycomm_torch::ProcessGroupPycomm*>(backend.get())) {
            ours->all_reduce_now(tensor, op);
            return;
          }
        }
        pycomm_torch::all_reduce_on(tensor, op, *pycomm_torch::live_group(group));
      },
      py::arg("tensor"), py::arg("op"), py::arg("group"), py::call_guard<py::gil_scoped_release>(),
      "pycomm.all_reduce_'s eager entry: the operator's kernel reached by one pybind call "
      "(no dispatcher), for any group and device.");
  pycomm_torch::register_work(m);
  register_islands(m);
  register_env_info(m);
  register_arena_allocator(m);
  m.def("arena_empty", &arena_empty, py::arg("sizes"), py::arg("dtype"),
        "An uninitialised CPU tensor in the shared-memory arena.");
  m.def(
      "_wait_workers_idle",
      [](double cap_s) {
        pycomm::Worker::wait_all_idle(std::chrono::milliseconds(static_cast<int64_t>(cap_s * 1e3)));
      },
      py::arg("cap_s"), py::call_guard<py::gil_scoped_release>(),
      "At exit: waits (the GIL released) until no group's worker runs or holds a task.");
  m.def("arena_stats", &arena_stats, "Bytes reserved, live and peak in this process's arena.");
  m.def(
      "arena_trim_bytes", [](size_t bytes) { pycomm::Arena::instance().set_trim_bytes(bytes); },
      py::arg("bytes"), "Freed arena blocks of at least `bytes` give their pages back (0: never).");
  m.def("_reduce_into", &reduce_into, py::arg("dst"), py::arg("a"), py::arg("b"),
        py::arg("op") = "sum", py::call_guard<py::gil_scoped_release>(),
        "dst = a op b with pycomm's reduction kernels (benchmarks and tests).");
  m.def("_reduce_copy", &reduce_copy_into, py::arg("dsts"), py::arg("srcs"), py::arg("op") = "sum",
        py::arg("scale") = 1.0, py::call_guard<py::gil_scoped_release>(),
        "Every dst = op over srcs in one pass (pycomm's reduce_copy kernel).");
  m.def("_allow_f16c", &pycomm::allow_f16c, py::arg("allowed"),
        "Tests: False makes the float16 kernels convert as on a CPU without F16C; returns "
        "the previous setting.");
  m.def("unbound_tensor", &pycomm_torch::unbound_tensor, py::arg("sizes"), py::arg("dtype"),
        "A contiguous CPU tensor of that shape whose storage holds no memory yet.");
  m.def("bind_storage", &pycomm_torch::bind_storage, py::arg("target"), py::arg("source"),
        "Point target's storage (and every view of it) at source's memory.");
  m.def("unbind_storage", &pycomm_torch::unbind_storage, py::arg("target"),
        "Make target's storage hold no memory again.");
  m.def("fused_bias_gelu", &pycomm_torch::fused_bias_gelu, py::arg("x"), py::arg("bias"),
        py::call_guard<py::gil_scoped_release>(), "gelu(x + bias), one pass.");
  m.def("fused_bias_gelu_backward", &pycomm_torch::fused_bias_gelu_backward, py::arg("grad"),
        py::arg("x"), py::arg("bias"), py::call_guard<py::gil_scoped_release>(),
        "grad * gelu'(x + bias), recomputing x + bias in the same pass.");
  m.def("fused_bias_dropout_add", &pycomm_torch::fused_bias_dropout_add, py::arg("x"),
        py::arg("bias"), py::arg("residual"), py::arg("p"), py::arg("seed"),
        py::call_guard<py::gil_scoped_release>(),
        "dropout(x + bias) + residual, the mask drawn from the seed.");
  m.def("fused_dropout_backward", &pycomm_torch::fused_dropout_backward, py::arg("grad"),
        py::arg("p"), py::arg("seed"), py::call_guard<py::gil_scoped_release>(),
        "grad * mask(seed) / (1 - p), the mask recomputed from the seed.");
  pycomm_torch::register_cuda_host(m);
#ifdef PYCOMM_CUDA
  pycomm_torch::register_fused_cuda(m);  // fused_*_cuda
#endif
  m.def("in_arena", &in_arena, py::arg("tensor"), "Whether the tensor's data lies in the arena.");
  m.def(
      "_inject_offer_faults",
      [](uint64_t offset_skew, uint64_t inode_skew) {
        pycomm::Faults::offer_offset_skew.store(offset_skew);
        pycomm::Faults::offer_inode_skew.store(inode_skew);
      },
      py::arg("offset_skew") = 0, py::arg("inode_skew") = 0,
      "Tests only: this rank's zero-copy offers post skewed offsets / slab inodes, as a "
      "broken or hostile peer would (0, 0 restores honest offers).");
  m.def(
      "_inject_buffer_fault", [](uint32_t skew) { pycomm::Faults::buffer_skew.store(skew); },
      py::arg("skew") = 0,
      "Tests only: the chunks this rank publishes name a buffer `skew` past the one that "
      "holds them, as a corrupted peer would (0 restores honest headers).");
#ifdef PYCOMM_CUDA
  constexpr bool kCudaBuilt = true;
#else
  constexpr bool kCudaBuilt = false;
#endif
  m.def("cuda_built", [] { return kCudaBuilt; }, "Whether the CUDA path was compiled in.");
  m.def(
      "_probe_segment",
      [](size_t bytes) {
        // Creates a segment exactly as a communicator would, reports how /dev/shm sees
        // it, and removes it: lets tests check names and permissions.
        auto seg = pycomm::ShmSegment::create(bytes, bytes, "a probe");
        struct stat st;
        std::string path = "/dev/shm" + seg.name();
        int rc = stat(path.c_str(), &st);
        return py::make_tuple(seg.name(), rc == 0 ? (st.st_mode & 0777) : -1,
                              rc == 0 ? static_cast<int64_t>(st.st_size) : -1);
      },
      py::arg("bytes"));
  m.def(
      "_open_segment",
      [](const std::string& name, size_t bytes) {
        // Opens a segment as a joining rank would (the same checks), then lets it go.
        pycomm_torch::translated([&] { pycomm::ShmSegment::open(name, bytes); });
      },
      py::arg("name"), py::arg("bytes"), "Tests only: map `name` as a joining rank would.");
  m.def(
      "_probe_cores",
      [](int cpu_a, int cpu_b, double budget_s) {
        pycomm::CoreProbe p;
        {
          py::gil_scoped_release nogil;  // two threads spin for budget_s
          p = pycomm::probe_cores(cpu_a, cpu_b, budget_s);
        }
        py::dict r;
        r["round_trip_ns"] = p.round_trip_ns;
        r["handoff_gbs"] = p.handoff_gbs;
        r["exchange_gbs"] = p.exchange_gbs;
        r["cpu_a"] = p.cpu_a;
        r["cpu_b"] = p.cpu_b;
        return r;
      },
      py::arg("cpu_a") = -1, py::arg("cpu_b") = -1, py::arg("budget_s") = 0.1,
      "Core-to-core round trip (ns), 256 KiB-slot handoff and two-way exchange (GB/s per "
      "direction) between two CPUs; -1 "
      "picks the first two of this thread's affinity set (bench/_c2c.py's reading).");
}
