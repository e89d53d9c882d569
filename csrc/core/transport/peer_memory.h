// Peers' arena slabs mapped into this process, so zero-copy collectives can read (and
// write) other ranks' tensors in place. A slab is mapped on first use through
// /proc/<owner pid>/fd/<memfd> and stays mapped until the communicator goes away.
//
// Everything a peer posts is checked before it is used: the file opened must be the
// one it describes (device, inode, size: in another PID namespace /proc/<pid> would
// name some other process), and every range must lie inside it.
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

  // The address, in this process, of the `bytes` at `loc` in rank `rank`'s arena.
  // Throws CommError naming both ranks if the slab cannot be mapped, is not the file
  // described, or does not hold the range.
  char* resolve(int rank, const ArenaLocation& loc, size_t bytes);

 private:
  struct Mapping {
    char* base;
    size_t bytes;
    uint64_t dev, ino;
  };
  Mapping map_slab(int rank, const ArenaLocation& loc);
  [[noreturn]] void refuse(int rank, const std::string& why) const;

  const Shared& shared_;
  std::map<std::pair<int, uint64_t>, Mapping> maps_;  // (rank, slab id) -> mapping
};

}  // namespace pycomm
