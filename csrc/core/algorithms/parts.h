// How algorithms that let every rank reduce its own part of a buffer split it.
#pragma once

#include <algorithm>
#include <cstddef>

#include "core/algorithms/ring_prims.h"

namespace pycomm {

// Rank r's contiguous part of `count` elements: an n-th, rounded up to whole cache
// lines so that no two ranks write one line.
inline Piece own_part(size_t count, int n, int r, size_t es) {
  const size_t line = std::max<size_t>(1, 64 / es);
  const size_t per_rank = ((count + n - 1) / n + line - 1) / line * line;
  const size_t begin = std::min(count, r * per_rank);
  return {begin, std::min(count, begin + per_rank) - begin};
}

}  // namespace pycomm
