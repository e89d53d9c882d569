#include "zero_copy.h"

#include <algorithm>
#include <cstring>

#include "reduce.h"
#include "ring_prims.h"

namespace pycomm {
namespace {

struct Offer {
  uint32_t in_arena;
  uint32_t pad;
  ArenaLocation where;
};

// Sources for this rank's part, its own buffer first: the result may be written over
// it (all_reduce in place, or an output that aliases the input), and the kernels allow
// the destination to be the first source only.
std::vector<const void*> own_first(const std::vector<char*>& bufs, int me, size_t offset) {
  std::vector<const void*> srcs{bufs[me] + offset};
  for (int r = 0; r < static_cast<int>(bufs.size()); ++r)
    if (r != me) srcs.push_back(bufs[r] + offset);
  return srcs;
}

}  // namespace

std::vector<char*> negotiate_zero_copy(Transport& t, PeerMemory& peers, const OpCall& op,
                                       const void* mine, size_t bytes) {
  auto* offer = static_cast<Offer*>(t.direct_buffer(op));
  offer->in_arena = Arena::instance().locate(mine, bytes, &offer->where) ? 1 : 0;
  t.post_direct(op);
  std::vector<char*> bufs(t.world(), nullptr);
  bool all = true;
  for (int r = 0; r < t.world(); ++r) {
    const auto* theirs = static_cast<const Offer*>(t.wait_direct(r, op));
    all = all && theirs->in_arena;
    if (all)
      bufs[r] = r == t.rank() ? static_cast<char*>(const_cast<void*>(mine))
                              : peers.resolve(r, theirs->where);
  }
  if (!all) bufs.clear();
  return bufs;
}

// Each round takes one chunk of every rank's part. Step 1: reduce our chunk from every
// rank's buffer into our own, in place (nobody else reads our part of our buffer then).
// Step 2, after the round's stage wait: copy every other rank's finished chunk. Rounds
// keep the chunk a peer just reduced in cache when we read it, and need one wait each:
// the next round's step 1 writes memory nobody reads in this round's step 2.
// A last wait keeps us from returning while a peer may still read our buffer.
void all_reduce_zero_copy(Transport& t, const OpCall& op, const Args& a,
                          const std::vector<char*>& bufs) {
  const int n = t.world(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  Partition parts(a.count, n, std::max<size_t>(1, t.chunk_bytes() / es));
  uint64_t stage = 0;
  for (size_t round = 0; round < parts.rounds(); ++round) {
    Piece mine = parts.piece(r, round);
    auto srcs = own_first(bufs, r, mine.offset * es);
    reduce_many(a.dtype, a.op, bufs[r] + mine.offset * es, srcs.data(), n, mine.count, a.scale);
    t.post_stage(op, ++stage);
    t.wait_stage(op, stage);
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      Piece theirs = parts.piece(q, round);
      size_t off = theirs.offset * es;
      std::memcpy(bufs[r] + off, bufs[q] + off, theirs.count * es);
    }
  }
  t.post_stage(op, ++stage);
  t.wait_stage(op, stage);
}

void reduce_scatter_zero_copy(Transport& t, const OpCall& op, const Args& a,
                              const std::vector<char*>& bufs) {
  const int r = t.rank();
  const size_t off = r * a.count * dtype_size(a.dtype);
  auto srcs = own_first(bufs, r, off);  // the output may alias our own input block
  reduce_many(a.dtype, a.op, a.out, srcs.data(), t.world(), a.count, a.scale);
  t.post_stage(op, 1);
  t.wait_stage(op, 1);
}

void all_gather_zero_copy(Transport& t, const OpCall& op, const Args& a,
                          const std::vector<char*>& bufs) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  auto* out = static_cast<char*>(a.out);
  for (int q = 0; q < t.world(); ++q) {
    if (out + q * bytes != bufs[q]) std::memmove(out + q * bytes, bufs[q], bytes);
  }
  t.post_stage(op, 1);
  t.wait_stage(op, 1);
}

}  // namespace pycomm
