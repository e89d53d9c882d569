// Ring all-gather: each rank's block travels n-1 steps round the ring; every rank keeps
// each block as it passes. The all-gather phase of the ring all-reduce, on its own.
#include <cstring>

#include "core/algorithms/algorithms.h"
#include "core/algorithms/ring_prims.h"

namespace pycomm {

void all_gather_ring(Transport& t, const OpCall& op, const Args& a) {
  const int n = t.world(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  auto* out = static_cast<char*>(a.out);
  Partition parts(a.count * n, n, t.chunk_bytes() / es);
  Prims prims(t, op, a.dtype, (r - 1 + n) % n, (r + 1) % n, a.count * n);
  auto at = [&](Piece p) { return out + p.offset * es; };
  if (a.in != out + parts.begin(r) * es) std::memcpy(out + parts.begin(r) * es, a.in, a.count * es);

  for (size_t round = 0; round < parts.rounds(); ++round) {
    auto piece = [&](long part) { return parts.piece(part, round); };
    // Step 0: send our own block.
    prims.send(at(piece(r)), piece(r));
    // Steps 1..n-2: keep the block from the previous rank and pass it on.
    for (int k = 0; k <= n - 3; ++k) {
      Piece p = piece(r - 1 - k);
      prims.recv_copy_send(at(p), p);
    }
    // Step n-1: the last block (from rank r+1) arrives.
    prims.recv_copy(at(piece(r + 1)), piece(r + 1));
  }
}

}  // namespace pycomm
