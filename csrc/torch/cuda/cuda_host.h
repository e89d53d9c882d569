// Bindings of the CUDA path's host-side logic (ring plan, its simulator, the IPC handle
// format). They exist in every build, so CI tests them without a GPU.
#pragma once

#include <pybind11/pybind11.h>

namespace pycomm_torch {

void register_cuda_host(pybind11::module& m);

}  // namespace pycomm_torch
