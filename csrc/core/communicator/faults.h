// Faults the tests inject through pycomm._C to play a broken or hostile peer: what such
// a rank would post, so the checks on the other side are tested for real. Zero in
// production; nothing reads them but the posting of offers and of channel buffers.
#pragma once

#include <atomic>
#include <cstdint>

#include "core/memory/arena.h"

namespace pycomm {

struct Faults {
  static std::atomic<uint64_t> offer_offset_skew;  // added to posted arena offsets
  static std::atomic<uint64_t> offer_inode_skew;   // added to posted slab inodes
  static std::atomic<uint32_t> buffer_skew;        // added to published buffer numbers
};

// What this rank posts of `where` (itself, unless a test injected faults).
inline ArenaLocation posted(ArenaLocation where) {
  where.offset += Faults::offer_offset_skew.load(std::memory_order_relaxed);
  where.ino += Faults::offer_inode_skew.load(std::memory_order_relaxed);
  return where;
}

}  // namespace pycomm
