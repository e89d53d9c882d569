// Broadcast and reduce as pipelined chains along the ring direction (r -> r+1):
// broadcast starts at the root, reduce ends at it. Chunk k of the message moves one hop
// per step, so with several slots per channel all hops work at once.
#include <cstring>

#include "core/algorithms/algorithms.h"
#include "core/algorithms/ring_prims.h"

namespace pycomm {

void broadcast_chain(Transport& t, const OpCall& op, const Args& a) {
  const int n = t.world(), r = t.rank();
  const int pos = (r - a.root + n) % n;  // hops from the root
  const size_t es = dtype_size(a.dtype);
  auto* data = static_cast<char*>(a.out);
  Partition whole(a.count, 1, t.chunk_bytes() / es);
  Prims prims(t, op, a.dtype, (r - 1 + n) % n, (r + 1) % n, a.count);
  for (size_t round = 0; round < whole.rounds(); ++round) {
    Piece p = whole.piece(0, round);
    char* at = data + p.offset * es;
    if (pos == 0)
      prims.send(at, p);  // the root feeds the chain
    else if (pos < n - 1)
      prims.recv_copy_send(at, p);  // keep it, pass it on
    else
      prims.recv_copy(at, p);  // the end of the chain
  }
}

void reduce_chain(Transport& t, const OpCall& op, const Args& a) {
  const int n = t.world(), r = t.rank();
  const int pos = (r - a.root - 1 + 2 * n) % n;  // root+1 starts, the root is last
  const size_t es = dtype_size(a.dtype);
  const auto* in = static_cast<const char*>(a.in);
  auto* out = static_cast<char*>(a.out);
  Partition whole(a.count, 1, t.chunk_bytes() / es);
  Prims prims(t, op, a.dtype, (r - 1 + n) % n, (r + 1) % n, a.count, a.op, a.scale);
  for (size_t round = 0; round < whole.rounds(); ++round) {
    Piece p = whole.piece(0, round);
    size_t off = p.offset * es;
    if (pos == 0)
      prims.send(in + off, p);  // start the partial sum
    else if (pos < n - 1)
      prims.recv_reduce_send(in + off, p);  // add ours, pass it on
    else
      prims.recv_reduce_copy(in + off, out + off, p);  // the root: final value
  }
}

}  // namespace pycomm
