// Peers' arena slabs mapped into this process, so zero-copy collectives can read (and
// write) other ranks' tensors in place. A slab is mapped on first use through
// /proc/<owner pid>/fd/<memfd> and stays mapped until the communicator goes away.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>

#include "core/memory/arena.h"
#include "core/transport/shared_state.h"

namespace pycomm {

class PeerMemory {
 public:
  explicit PeerMemory(const Shared& shared) : shared_(shared) {}
  ~PeerMemory();
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;

  // The address, in this process, of `loc` in rank `rank`'s arena (throws CommError
  // naming both ranks if the slab cannot be mapped).
  char* resolve(int rank, const ArenaLocation& loc);

 private:
  const Shared& shared_;
  std::map<std::pair<int, uint64_t>, std::pair<char*, size_t>> maps_;  // (rank, slab) -> map
};

}  // namespace pycomm
