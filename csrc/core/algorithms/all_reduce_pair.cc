// All-reduce between two ranks: each sends its whole buffer, chunk by chunk, and reduces
// the other's chunk into its own. The ring for two ranks moves the same bytes between the
// cores (each half out, each reduced half back) but reads this rank's buffer twice (the
// half it sends, then, a phase later, the half it gathers into, long evicted) and makes
// each chunk wait on two hand-offs in a row. Here a chunk is copied out and reduced
// within one step while it is still in this core's cache: the buffer is streamed once (a
// read-modify-write pass, the least a private buffer allows), with one hand-off per chunk
// each way, and neither rank ever waits on a result the other has still to compute.
//
// Both ranks reduce (rank 0's chunk op rank 1's chunk) in that order, so their results
// are bit-identical.
#include <algorithm>
#include <cstring>

#include "core/algorithms/algorithms.h"
#include "core/kernels/reduce.h"

namespace pycomm {

void all_reduce_pair(Transport& t, const OpCall& op, const Args& a) {
  const int me = t.rank(), peer = 1 - me;
  const size_t es = dtype_size(a.dtype);
  const size_t chunk = std::max<size_t>(1, t.chunk_bytes() / es);
  const size_t rounds = std::max<size_t>(1, (a.count + chunk - 1) / chunk);
  const size_t msg_bytes = a.count * es;
  const auto* in = static_cast<const char*>(a.in);
  auto* out = static_cast<char*>(a.out);
  auto begin = [&](size_t k) { return std::min(k * chunk, a.count) * es; };
  auto bytes = [&](size_t k) { return begin(k + 1) - begin(k); };
  auto send = [&](size_t k) {
    std::memcpy(t.acquire(peer, op), in + begin(k), bytes(k));
    t.publish(peer, op, begin(k), bytes(k), msg_bytes);
  };

  auto reduce = [&](size_t k) {
    const void* theirs = t.receive(peer, op, begin(k), bytes(k), msg_bytes);
    const void* mine = in + begin(k);
    const void* first = me == 0 ? mine : theirs;
    const void* second = me == 0 ? theirs : mine;
    reduce_pair(a.dtype, a.op, out + begin(k), first, second, bytes(k) / es, a.scale);
    t.release(peer);
  };
  size_t sent = 0, reduced = 0;
  auto can_send = [&] { return sent < rounds && t.can_acquire(peer); };
  auto can_reduce = [&] { return reduced < sent && t.peek(peer) != nullptr; };
  while (reduced < rounds) {
    if (can_reduce()) {
      reduce(reduced++);
    } else if (can_send()) {
      send(sent++);
    } else {
      t.wait_for(op, peer, [&] { return can_reduce() || can_send(); });
    }
  }
}

}  // namespace pycomm
