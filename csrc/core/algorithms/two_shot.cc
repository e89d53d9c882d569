// The two-shot all_reduce, for more than two ranks and messages past the direct size:
// every rank stages its input in its own stage area, then reduces its own part of it
// from every rank's area (the reduce-scatter shot) and copies every other rank's
// reduced part out of that rank's area (the all-gather shot). Two steps per piece where
// the ring takes 2(n-1) per chunk, for about the ring's memory traffic: what a rank
// that shares its core waits for is the scheduler, once per step, so fewer steps win
// (records/README.md). Each part is reduced by one rank, sources in rank order, so every
// rank gets bit-identical results.
//
// Messages longer than a piece go in pieces, alternately in the two halves of the area.
// Rank r writes piece k into a half that its peers last read for piece k - 2; each peer
// posted piece k - 1's first step after that, and r waited for that step before piece k,
// so no extra wait is needed. Across ops the area's parity does the same (stage_area).
//
// reduce_scatter and all_gather are the two shots alone, one step per piece: a rank
// writes piece k into the half its peers read for piece k - 2, and each peer posted
// piece k - 1 after reading it, which this rank waited for before piece k.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/algorithms/algorithms.h"
#include "core/algorithms/parts.h"
#include "core/kernels/reduce.h"

namespace pycomm {
namespace {

// The two steps of piece k, numbered from 1 as Transport's steps are.
uint64_t staged_step(size_t k) { return 2 * k + 1; }
uint64_t reduced_step(size_t k) { return 2 * k + 2; }

struct StageAreas {
  char* mine;
  std::vector<const char*> all;   // every rank's, this rank's own included
  std::vector<const void*> srcs;  // reduce_my_part's sources, allocated once per op
};

StageAreas stage_areas(Transport& t, const OpCall& op) {
  const auto n = static_cast<size_t>(t.world());
  StageAreas s{t.stage_area(op), std::vector<const char*>(n), std::vector<const void*>(n)};
  for (int r = 0; r < t.world(); ++r) s.all[r] = r == t.rank() ? s.mine : t.peer_stage_area(r, op);
  return s;
}

// Reduces this rank's part of the piece (`len` elements, staged at `half` of every area)
// into its output and into its own area, where the others copy it from.
void reduce_my_part(const Args& a, int n, int rank, StageAreas& s, size_t half, char* out,
                    size_t len) {
  const size_t es = dtype_size(a.dtype);
  Piece mine = own_part(len, n, rank, es);
  if (mine.count == 0) return;
  for (int q = 0; q < n; ++q) s.srcs[q] = s.all[q] + half + mine.offset * es;
  void* dsts[2] = {out + mine.offset * es, s.mine + half + mine.offset * es};
  reduce_copy(a.dtype, a.op, dsts, 2, s.srcs.data(), n, mine.count, a.scale);
}

void copy_others_parts(const Args& a, int n, int rank, const StageAreas& s, size_t half, char* out,
                       size_t len) {
  const size_t es = dtype_size(a.dtype);
  for (int q = 0; q < n; ++q) {
    Piece part = own_part(len, n, q, es);
    if (q != rank && part.count > 0)
      std::memcpy(out + part.offset * es, s.all[q] + half + part.offset * es, part.count * es);
  }
}

// reduce_scatter's piece: `len` elements of every rank's block, staged block after block,
// a whole number of cache lines so that no two blocks share one.
size_t block_piece_bytes(size_t piece_bytes, int n) { return piece_bytes / n / 64 * 64; }

}  // namespace

bool reduce_scatter_two_shot_fits(size_t count, size_t es, int n, size_t piece_bytes) {
  const size_t block = block_piece_bytes(piece_bytes, n);
  return block >= es && (count * es + block - 1) / block < Transport::kStagesPerOp;
}

void reduce_scatter_two_shot(Transport& t, const OpCall& op, const Args& a) {
  const int n = t.world();
  const size_t es = dtype_size(a.dtype);
  const size_t piece = block_piece_bytes(t.stage_piece_bytes(), n) / es;
  StageAreas s = stage_areas(t, op);
  const auto* in = static_cast<const char*>(a.in);
  auto* out = static_cast<char*>(a.out);
  const size_t block = a.count * es;  // one rank's block of the input
  for (size_t k = 0, first = 0; first < a.count; ++k, first += piece) {
    const size_t len = std::min(piece, a.count - first);
    char* staged = s.mine + (k & 1) * t.stage_piece_bytes();
    // The others' blocks only: this rank reduces its own straight from its input.
    for (int q = 0; q < n; ++q)
      if (q != t.rank())
        std::memcpy(staged + q * piece * es, in + q * block + first * es, len * es);
    t.post_stage(op, k + 1);
    t.wait_stage(op, k + 1);
    const size_t mine = (k & 1) * t.stage_piece_bytes() + t.rank() * piece * es;
    for (int q = 0; q < n; ++q) s.srcs[q] = s.all[q] + mine;
    s.srcs[t.rank()] = in + t.rank() * block + first * es;
    void* dst = out + first * es;
    reduce_copy(a.dtype, a.op, &dst, 1, s.srcs.data(), n, len, a.scale);
  }
}

void all_gather_two_shot(Transport& t, const OpCall& op, const Args& a) {
  const int n = t.world();
  const size_t es = dtype_size(a.dtype);
  const size_t piece = t.stage_piece_bytes() / es;
  StageAreas s = stage_areas(t, op);
  const auto* in = static_cast<const char*>(a.in);
  auto* out = static_cast<char*>(a.out);
  const size_t block = a.count * es;  // one rank's block of the output
  for (size_t k = 0, first = 0; first < a.count; ++k, first += piece) {
    const size_t len = std::min(piece, a.count - first);
    const size_t half = (k & 1) * t.stage_piece_bytes();
    // The input may be this rank's block of the output (in place): stage it first.
    std::memcpy(s.mine + half, in + first * es, len * es);
    t.post_stage(op, k + 1);
    t.wait_stage(op, k + 1);
    for (int q = 0; q < n; ++q)
      std::memcpy(out + q * block + first * es, s.all[q] + half, len * es);
  }
}

void all_reduce_two_shot(Transport& t, const OpCall& op, const Args& a) {
  const int n = t.world();
  const size_t es = dtype_size(a.dtype);
  const size_t piece_bytes = t.stage_piece_bytes();
  const size_t piece = piece_bytes / es;  // a multiple of 64 bytes: whole elements
  StageAreas s = stage_areas(t, op);
  const auto* in = static_cast<const char*>(a.in);
  auto* out = static_cast<char*>(a.out);
  for (size_t k = 0, first = 0; first < a.count; ++k, first += piece) {
    const size_t len = std::min(piece, a.count - first);
    const size_t half = (k & 1) * piece_bytes;
    // In place (in == out) is safe: the piece is staged before any of it is written.
    std::memcpy(s.mine + half, in + first * es, len * es);
    t.post_stage(op, staged_step(k));
    t.wait_stage(op, staged_step(k));
    reduce_my_part(a, n, t.rank(), s, half, out + first * es, len);
    t.post_stage(op, reduced_step(k));
    t.wait_stage(op, reduced_step(k));
    copy_others_parts(a, n, t.rank(), s, half, out + first * es, len);
  }
}

}  // namespace pycomm
