// pycomm._C: the backend class for torch.distributed, and a few core facts for Python.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <chrono>

#include <sys/stat.h>

#include "../core/config.h"
#include "../core/shm_segment.h"
#include "backend.h"

namespace py = pybind11;

namespace {

c10::intrusive_ptr<pycomm_torch::ProcessGroupPycomm> create(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, double timeout_s) {
  auto ms = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
  return c10::make_intrusive<pycomm_torch::ProcessGroupPycomm>(store, rank, size, ms);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pycomm's C++ core: the shared-memory torch.distributed backend";
  // Backend is registered by torch; deriving from it lets torch attach ours to a ProcessGroup.
  py::module_::import("torch.distributed");
  py::class_<pycomm_torch::ProcessGroupPycomm, c10d::Backend,
             c10::intrusive_ptr<pycomm_torch::ProcessGroupPycomm>>(m, "ProcessGroupPycomm")
      .def(py::init(&create), py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "Joins the group's shared-memory segment (collective: every rank must call it).")
      .def_property_readonly("segment_bytes", &pycomm_torch::ProcessGroupPycomm::segment_bytes);
  m.def("cuda_built", [] { return false; }, "Whether the CUDA path was compiled in.");
  m.def(
      "_probe_segment",
      [](size_t bytes) {
        // Creates a segment exactly as a communicator would, reports how /dev/shm sees
        // it, and removes it: lets tests check names and permissions.
        auto seg = pycomm::ShmSegment::create(bytes, "a probe");
        struct stat st;
        std::string path = "/dev/shm" + seg.name();
        int rc = stat(path.c_str(), &st);
        return py::make_tuple(seg.name(), rc == 0 ? (st.st_mode & 0777) : -1,
                              rc == 0 ? static_cast<int64_t>(st.st_size) : -1);
      },
      py::arg("bytes"));
}
