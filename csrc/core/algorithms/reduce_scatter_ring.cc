// Ring reduce-scatter: the first phase of the ring all-reduce, ending with each rank
// holding the reduced part whose index is its rank, written to its output.
#include <cstring>

#include "core/algorithms/algorithms.h"
#include "core/algorithms/ring_prims.h"

namespace pycomm {

void reduce_scatter_ring(Transport& t, const OpCall& op, const Args& a) {
  const int n = t.world(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  const auto* in = static_cast<const char*>(a.in);
  auto* out = static_cast<char*>(a.out);
  // Parts are exactly `count` long, so piece offsets line up with the input blocks.
  Partition parts(a.count * n, n, t.chunk_bytes() / es);
  Prims prims(t, op, a.dtype, (r - 1 + n) % n, (r + 1) % n, a.count * n, a.op, a.scale);
  auto at = [&](Piece p) { return in + p.offset * es; };

  for (size_t round = 0; round < parts.rounds(); ++round) {
    auto piece = [&](long part) { return parts.piece(part, round); };
    // Step 0: push our contribution to part r-1.
    prims.send(at(piece(r - 1)), piece(r - 1));
    // Steps 1..n-2: add ours and pass on.
    for (int k = 1; k <= n - 2; ++k) {
      Piece p = piece(r - 1 - k);
      prims.recv_reduce_send(at(p), p);
    }
    // Step n-1: the sum for part r is complete: write it to the output.
    Piece mine = piece(r);
    prims.recv_reduce_copy(at(mine), out + (mine.offset - parts.begin(r)) * es, mine);
  }
}

}  // namespace pycomm
