// The process's shared-memory arena (ZeRO-R's M_D): tensors from pycomm.empty() live in
// large preallocated slabs that other local ranks can map, so collectives on them read
// peers' data in place instead of copying it through the transport.
//
// Slabs are anonymous memfd files: nothing appears in /dev/shm, so nothing can be left
// behind; a peer maps a slab through /proc/<pid>/fd/<fd> (see PeerMemory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace pycomm {

// Where a byte range of the arena lives, as a peer needs to know it. The peer checks
// that what it opens is this very file (device and inode) before it maps it.
struct ArenaLocation {
  int32_t fd = -1;  // the slab's memfd in the owner process
  uint32_t pad = 0;
  uint64_t slab_id = 0;  // unique per process, never reused
  uint64_t slab_bytes = 0;
  uint64_t offset = 0;  // of the range within the slab
  uint64_t dev = 0;     // st_dev and st_ino of the memfd
  uint64_t ino = 0;
};

struct ArenaStats {
  size_t reserved = 0;  // bytes of all slabs
  size_t live = 0;      // bytes handed out and not yet freed
  size_t peak = 0;      // highest `live` so far
  size_t slabs = 0;
  size_t allocations = 0;   // live allocations
  size_t largest_free = 0;  // largest block available without a new slab
  size_t trimmed = 0;       // bytes of free blocks whose pages went back to the system
};

class Arena {
 public:
  static Arena& instance();

  // 64-byte aligned memory of at least `bytes`; a new slab is reserved when no free
  // block fits (throws CommError, naming the size, if the memory cannot be reserved).
  void* allocate(size_t bytes);
  // False (and nothing done) when `ptr` is not an allocation of this arena.
  bool release(void* ptr);
  // True (and *out filled) if [ptr, ptr + bytes) lies inside one slab of this arena.
  bool locate(const void* ptr, size_t bytes, ArenaLocation* out) const;
  ArenaStats stats() const;
  // From now on a freed block of at least `bytes` gives its pages back to the system
  // (punched out of the slab's memfd, for every process mapping it) and a block handed
  // out again is reserved anew; 0 (the default) keeps every page, as slabs always did.
  void set_trim_bytes(size_t bytes);
  // Called in a forked child (see fork_guard.h).
  static void after_fork_in_child();

 private:
  struct Slab {
    int fd;
    uint64_t id;
    char* base;
    size_t bytes;
    uint64_t dev, ino;              // the memfd's identity
    std::map<size_t, size_t> free;  // offset -> length, coalesced
  };
  Slab* new_slab(size_t min_bytes);
  static void* take(Slab& s, size_t bytes);
  static void give_back(Slab& s, size_t offset, size_t bytes);
  size_t punch(Slab& s, size_t offset, size_t bytes);
  void reserve_again(Slab& s, size_t offset, size_t bytes);

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  std::map<const char*, std::pair<Slab*, size_t>> live_;  // ptr -> (slab, bytes)
  size_t live_bytes_ = 0;
  size_t peak_bytes_ = 0;
  size_t trim_bytes_ = 0;
  size_t trimmed_bytes_ = 0;  // punched and not handed out since (an upper bound)
  bool ever_trimmed_ = false;
  uint64_t next_id_ = 1;
};

}  // namespace pycomm
