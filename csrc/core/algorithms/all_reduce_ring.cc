// Ring all-reduce: a reduce-scatter phase then an all-gather phase, as in NCCL's runRing.
// The buffer is cut into `world` parts; each round moves one slot-sized chunk of every
// part one step round the ring, so successive rounds pipeline across ranks.
#include "core/algorithms/algorithms.h"
#include "core/algorithms/ring_prims.h"

namespace pycomm {

void all_reduce_ring(Transport& t, const OpCall& op, const Args& a) {
  const int n = t.world(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  auto* data = static_cast<char*>(a.out);
  Partition parts(a.count, n, t.chunk_bytes() / es);
  Prims prims(t, op, a.dtype, (r - 1 + n) % n, (r + 1) % n, a.count, a.op, a.scale);
  auto at = [&](Piece p) { return data + p.offset * es; };

  for (size_t round = 0; round < parts.rounds(); ++round) {
    auto piece = [&](long part) { return parts.piece(part, round); };
    // Step 0: push our contribution to part r-1 to the next rank.
    prims.send(at(piece(r - 1)), piece(r - 1));
    // Steps 1..n-2: add ours to the partial sum from the previous rank and pass it on.
    for (int k = 1; k <= n - 2; ++k) {
      Piece p = piece(r - 1 - k);
      prims.recv_reduce_send(at(p), p);
    }
    // Step n-1: part r is now complete here: keep it (scaled once, for AVG), pass it on.
    prims.recv_reduce_copy_send(at(piece(r)), at(piece(r)), piece(r));
    // Steps n..2n-3: finished parts come round: keep each and pass it on.
    for (int k = 0; k <= n - 3; ++k) {
      Piece p = piece(r - 1 - k);
      prims.recv_copy_send(at(p), p);
    }
    // Step 2n-2: the last finished part (r+1) arrives; every rank has sent it on already.
    prims.recv_copy(at(piece(r + 1)), piece(r + 1));
  }
}

}  // namespace pycomm
