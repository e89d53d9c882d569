// PycommWork as Python sees it: torch's Work with a wait() that keeps the GIL when the
// op is already finished. A synchronous dist.all_reduce returns a finished Work and then
// calls wait() on it; torch's binding of Work.wait releases and retakes the GIL around
// the call, and torch's holder releases it again to destroy the Work: together about a
// third of a microsecond of a 1 KB all-reduce. pybind11 hands out each Work as its most
// derived registered type, so registering PycommWork here is all a caller needs.
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "torch/backend/work.h"

namespace py = pybind11;

namespace pycomm_torch {

void register_work(py::module_& m) {
  // torch registers c10d::Work (torch.distributed.Work) when torch.distributed loads.
  py::module_::import("torch.distributed");
  // Holder: a plain intrusive_ptr, so that the last reference is dropped with the GIL
  // held. That is safe here: ~PycommWork waits for nothing (the worker that completes
  // a Work holds a reference until it is done with it).
  py::class_<PycommWork, c10::intrusive_ptr<PycommWork>, c10d::Work>(
      m, "Work", "The Work of a pycomm op (a torch.distributed.Work).")
      .def(
          "wait",
          [](PycommWork& work, std::chrono::milliseconds timeout) {
            // Finished: returns (or raises the op's error) at once, nothing to wait for.
            if (work.isCompleted()) return work.wait(timeout);
            py::gil_scoped_release no_gil;  // a callback on the worker may need it
            return work.wait(timeout);
          },
          py::arg("timeout") = kNoTimeout,
          "Waits for the op (at most `timeout`, 0: no limit); raises its error if it failed.");
}

}  // namespace pycomm_torch
