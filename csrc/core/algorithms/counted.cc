// The all_to_all that learns its receive counts inside the op (expert parallelism's
// dispatch, DeepEP's idea on this transport): the counts ride in the offer every rank
// posts anyway, so the sizes cost no exchange of their own.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/algorithms/algorithms.h"
#include "core/algorithms/all_to_all_offer.h"
#include "core/base/errors.h"

namespace pycomm {
namespace {

// After the offer's block table: the sender's row size, its group count and its rows
// per (peer, group).
struct CountedTail {
  uint64_t row_elems;
  uint64_t groups;
  uint64_t counts[1];  // world x groups
};

size_t tail_offset(int world) { return (all_to_all_offer_bytes(world) + 7) & ~size_t{7}; }

CountedTail* tail_of(void* offer, int world) {
  return reinterpret_cast<CountedTail*>(static_cast<char*>(offer) + tail_offset(world));
}

const CountedTail* tail_of(const void* offer, int world) {
  return reinterpret_cast<const CountedTail*>(static_cast<const char*>(offer) + tail_offset(world));
}

std::string rank_text(int r) { return "rank " + std::to_string(r); }

// Rows x row_elems, refusing what does not fit in size_t (counts may come from a peer).
size_t elements_of(uint64_t rows, size_t row_elems, int from, int to) {
  uint64_t elems;
  if (__builtin_mul_overflow(rows, row_elems, &elems) || elems > SIZE_MAX) {
    throw CommError("pycomm: all_to_all_counted: " + rank_text(from) + " sends " + rank_text(to) +
                    " " + std::to_string(rows) + " rows of " + std::to_string(row_elems) +
                    " elements, which overflows");
  }
  return static_cast<size_t>(elems);
}

// The plain all_to_all of this rank's sends: elements per peer and their offsets.
AllToAllArgs send_side(const CountedAllToAllArgs& a, int n, int me) {
  AllToAllArgs x;
  x.in = a.in;
  x.dtype = a.dtype;
  size_t offset = 0;
  for (int q = 0; q < n; ++q) {
    uint64_t rows = 0;
    for (size_t g = 0; g < a.groups; ++g) rows += a.send_counts[q * a.groups + g];
    const size_t elems = elements_of(rows, a.row_elems, me, q);
    x.send_offsets.push_back(offset);
    x.send_counts.push_back(elems);
    if (__builtin_add_overflow(offset, elems, &offset)) {
      throw InvalidArgument("pycomm: all_to_all_counted: " + rank_text(me) +
                            "'s input overflows size_t elements");
    }
  }
  return x;
}

// What `from` sends this rank, per group, after checking its offer agrees with ours
// and with itself (the rows it counts are the elements of its block for us).
void read_counts(const AllToAllOffer& theirs, const CountedTail& tail, const CountedAllToAllArgs& a,
                 int from, int me, int n, uint64_t* rows_out) {
  if (theirs.world != static_cast<uint32_t>(n) || tail.groups != a.groups ||
      tail.row_elems != a.row_elems) {
    throw InvalidArgument("pycomm: all_to_all_counted: " + rank_text(me) + " sends rows of " +
                          std::to_string(a.row_elems) + " elements in " + std::to_string(a.groups) +
                          " groups per rank, but " + rank_text(from) + " rows of " +
                          std::to_string(tail.row_elems) + " in " + std::to_string(tail.groups) +
                          " (hidden sizes or experts per rank "
                          "differ)");
  }
  uint64_t rows = 0;
  for (size_t g = 0; g < a.groups; ++g) {
    rows_out[g] = tail.counts[static_cast<size_t>(me) * a.groups + g];
    if (__builtin_add_overflow(rows, rows_out[g], &rows)) {
      throw CommError("pycomm: all_to_all_counted: " + rank_text(from) + "'s counts overflow");
    }
  }
  if (rows > static_cast<uint64_t>(INT64_MAX)) {
    throw CommError("pycomm: all_to_all_counted: " + rank_text(from) + " counts " +
                    std::to_string(rows) + " rows for " + rank_text(me));
  }
  if (elements_of(rows, a.row_elems, from, me) != theirs.blocks[me].count) {
    throw CommError("pycomm: all_to_all_counted: " + rank_text(from) + " counts " +
                    std::to_string(rows) + " rows for " + rank_text(me) + " but posts " +
                    std::to_string(theirs.blocks[me].count) + " elements");
  }
}

}  // namespace

size_t all_to_all_counted_offer_bytes(int world, size_t groups) {
  return tail_offset(world) + offsetof(CountedTail, counts) +
         static_cast<size_t>(world) * groups * sizeof(uint64_t);
}

int all_to_all_counted(Transport& t, PeerMemory& peers, const OpCall& op,
                       const CountedAllToAllArgs& a, bool may_pull) {
  const int n = t.world(), me = t.rank();
  AllToAllArgs x = send_side(a, n, me);
  AllToAllOffer* mine = fill_all_to_all_offer(t, op, x, may_pull);
  CountedTail* tail = tail_of(mine, n);
  tail->row_elems = a.row_elems;
  tail->groups = a.groups;
  for (size_t i = 0; i < a.send_counts.size(); ++i) tail->counts[i] = a.send_counts[i];
  t.post_direct(op);

  std::vector<uint64_t> recv(static_cast<size_t>(n) * a.groups);
  size_t offset = 0;
  for (int q = 0; q < n; ++q) {
    uint64_t* rows = recv.data() + static_cast<size_t>(q) * a.groups;
    if (q == me) {
      for (size_t g = 0; g < a.groups; ++g) rows[g] = a.send_counts[me * a.groups + g];
    } else {
      const void* theirs = t.wait_direct(q, op);
      read_counts(*static_cast<const AllToAllOffer*>(theirs), *tail_of(theirs, n), a, q, me, n,
                  rows);
    }
    const size_t elems =
        q == me ? x.send_counts[me]
                : static_cast<const AllToAllOffer*>(t.wait_direct(q, op))->blocks[me].count;
    x.recv_offsets.push_back(offset);
    x.recv_counts.push_back(elems);
    if (__builtin_add_overflow(offset, elems, &offset)) {
      throw CommError("pycomm: all_to_all_counted: " + rank_text(me) +
                      " would receive more than size_t elements");
    }
  }
  x.out = a.allocate(recv);
  return move_all_to_all_blocks(t, peers, op, x, *mine);
}

}  // namespace pycomm
