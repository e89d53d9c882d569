// The offer an all_to_all posts in its direct area, shared by the all_to_all with known
// counts (pairwise.cc) and the one that learns them inside the op (counted.cc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/algorithms/algorithms.h"
#include "core/memory/arena.h"
#include "core/transport/peer_memory.h"
#include "core/transport/transport.h"

namespace pycomm {

// What a rank posts before an all_to_all: whether its input is in the arena (and so may
// be read in place), where, and which block of it goes to each rank.
struct AllToAllOffer {
  uint32_t pull_me;
  uint32_t world;
  uint64_t pid_ns;  // peers read in place only within one PID namespace
  ArenaLocation where;
  struct Block {
    uint64_t offset, count;  // elements
  } blocks[1];               // world of them
};

// This rank's offer for `a`, written in its direct area but not posted. `may_pull`:
// whether peers may read its input in place (when it is in the arena).
AllToAllOffer* fill_all_to_all_offer(Transport& t, const OpCall& op, const AllToAllArgs& a,
                                     bool may_pull);
// After every rank posted its offer: moves the blocks, reading in place where the
// sender allows it, else through the slots. Returns how many peers were read in place.
int move_all_to_all_blocks(Transport& t, PeerMemory& peers, const OpCall& op, const AllToAllArgs& a,
                           const AllToAllOffer& mine);

}  // namespace pycomm
