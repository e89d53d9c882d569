// Element operations shared by the reduction kernels.
#pragma once

#include <type_traits>

#include "core/kernels/kernel_attrs.h"

namespace pycomm {

// MIN and MAX let a NaN win, as torch.minimum/maximum and the CUDA kernels do: a plain
// compare keeps or drops it depending on which rank's value comes first. (a + b is
// NaN when either is; the select vectorises.)
template <typename T>
PYCOMM_INLINE T nan_wins(T a, T b, T picked) {
  if constexpr (std::is_floating_point_v<T>) return (a != a || b != b) ? a + b : picked;
  return picked;
}

}  // namespace pycomm
