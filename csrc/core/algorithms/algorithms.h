// Every collective algorithm of the core. Each runs on one rank, inside one OpCall, over
// the Transport; all ranks must run the same algorithm for the same sequence number
// (the Communicator picks it from the call alone, so they do).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/base/types.h"
#include "core/transport/transport.h"

namespace pycomm {

class PeerMemory;

struct Args {
  const void* in = nullptr;  // this rank's input
  void* out = nullptr;       // this rank's output (== in for in-place ops)
  size_t count = 0;          // elements: the buffer (all_reduce, broadcast, reduce) or per rank
  DType dtype = DType::F32;
  RedOp op = RedOp::NONE;  // kernel op (see kernel_op)
  double scale = 1.0;      // applied once to the final value (AVG)
  int root = 0;
};

// Chunked, pipelined rings (ring allreduce = reduce-scatter phase + all-gather phase).
void all_reduce_ring(Transport& t, const OpCall& op, const Args& a);
void reduce_scatter_ring(Transport& t, const OpCall& op, const Args& a);  // in: world*count
void all_gather_ring(Transport& t, const OpCall& op, const Args& a);      // out: world*count
// Two ranks: each streams its whole buffer to the other and reduces what comes back in.
void all_reduce_pair(Transport& t, const OpCall& op, const Args& a);
// More ranks, mid sizes: stage, reduce one's own part from every stage, copy the rest
// (two_shot.cc). Needs the group's stage areas (GroupSettings::two_shot_bytes > 0).
void all_reduce_two_shot(Transport& t, const OpCall& op, const Args& a);
// The two shots alone, one step per piece. reduce_scatter stages a piece of every rank's
// block at once, so it needs the stage piece to hold n cache lines and the op to take
// fewer pieces than it has steps: reduce_scatter_two_shot_fits says whether it does.
void reduce_scatter_two_shot(Transport& t, const OpCall& op, const Args& a);  // in: world*count
void all_gather_two_shot(Transport& t, const OpCall& op, const Args& a);      // out: world*count
bool reduce_scatter_two_shot_fits(size_t count, size_t es, int n, size_t piece_bytes);

// Chains along the ring, pipelined chunk by chunk.
void broadcast_chain(Transport& t, const OpCall& op, const Args& a);
void reduce_chain(Transport& t, const OpCall& op, const Args& a);

// Direct: every rank posts its whole input once, then reads what it needs from all.
void all_reduce_direct(Transport& t, const OpCall& op, const Args& a);
void reduce_scatter_direct(Transport& t, const OpCall& op, const Args& a);
void all_gather_direct(Transport& t, const OpCall& op, const Args& a);
void broadcast_direct(Transport& t, const OpCall& op, const Args& a);
void reduce_direct(Transport& t, const OpCall& op, const Args& a);
void barrier_direct(Transport& t, const OpCall& op);

// Point-to-point patterns over the full mesh of channels.
struct AllToAllArgs {
  const void* in = nullptr;
  void* out = nullptr;
  DType dtype = DType::F32;
  std::vector<size_t> send_counts, send_offsets;  // elements, per peer
  std::vector<size_t> recv_counts, recv_offsets;
};
void all_to_all_pairwise(Transport& t, const OpCall& op, const AllToAllArgs& a);
// Pairwise, except that a rank whose input is in the arena posts it and its peers copy
// their blocks straight out of it: one copy instead of two through a slot. Every rank
// posts an offer of all_to_all_offer_bytes(world) in its direct area. Returns how many
// peers this rank pulled from.
int all_to_all_pull(Transport& t, PeerMemory& peers, const OpCall& op, const AllToAllArgs& a);
size_t all_to_all_offer_bytes(int world);

// An all_to_all of rows whose receive counts are not known beforehand: each rank posts
// how many rows it sends each peer - split into `groups` counts per peer (expert
// parallelism's dispatch: the rows for each of that peer's experts, in order) - in the
// same offer as its blocks, reads its peers', has `allocate` return the output for the
// rows it will receive, then moves the rows as all_to_all_pull does. One op: no separate
// exchange of the counts and no return to the caller between the two.
struct CountedAllToAllArgs {
  const void* in = nullptr;
  DType dtype = DType::F32;
  size_t row_elems = 0;               // elements per row (the same on every rank)
  size_t groups = 1;                  // counts per peer (the same on every rank)
  std::vector<uint64_t> send_counts;  // rows, world x groups, peer-major, as `in` holds them
  // Given the rows received, world x groups, source-major: where to put them (at least
  // their total x row_elems elements), in source order.
  std::function<void*(const std::vector<uint64_t>& recv_counts)> allocate;
};
// Returns how many peers were read in place. Throws InvalidArgument when the peers'
// row size or group count differ from this rank's, CommError when a peer's counts are
// not consistent with its blocks.
int all_to_all_counted(Transport& t, PeerMemory& peers, const OpCall& op,
                       const CountedAllToAllArgs& a, bool may_pull);
// The direct-area bytes its offer takes.
size_t all_to_all_counted_offer_bytes(int world, size_t groups);
void gather_to_root(Transport& t, const OpCall& op, const Args& a);     // out: world*count at root
void scatter_from_root(Transport& t, const OpCall& op, const Args& a);  // in: world*count at root

}  // namespace pycomm
