// Zero-copy collectives for buffers in the shared-memory arena: every rank reads its
// peers' tensors in place (mapped through PeerMemory) instead of streaming them through
// the transport's slots. Used only when every rank's buffer is in the arena; the ranks
// find out together, in one exchange, so they all take the same path.
#pragma once

#include <vector>

#include "core/algorithms/algorithms.h"
#include "core/memory/arena.h"
#include "core/transport/peer_memory.h"
#include "core/transport/transport.h"

namespace pycomm {

// What the ranks found out together: every rank's buffer as mapped here, or none, and
// then why not (the same on every rank, so all fall back together).
struct ZeroCopyPlan {
  std::vector<char*> bufs;
  const char* why_not = "";
};

// Posts where this rank's buffer `mine` (bytes long) lives, if it is in the arena, and
// reads everyone's posts. Zero-copy needs every buffer in the arena and every rank in
// one PID namespace (peers' arena memory is opened through /proc/<pid>).
ZeroCopyPlan negotiate_zero_copy(Transport& t, PeerMemory& peers, const OpCall& op,
                                 const void* mine, size_t bytes);

// `bufs` from negotiate_zero_copy. all_reduce works in place on bufs[rank];
// reduce_scatter and all_gather read bufs (the inputs) and write a.out.
void all_reduce_zero_copy(Transport& t, const OpCall& op, const Args& a,
                          const std::vector<char*>& bufs);
void reduce_scatter_zero_copy(Transport& t, const OpCall& op, const Args& a,
                              const std::vector<char*>& bufs);
void all_gather_zero_copy(Transport& t, const OpCall& op, const Args& a,
                          const std::vector<char*>& bufs);
// Every rank reduces its n-th of all buffers into the root's (a.in == a.out there).
void reduce_zero_copy(Transport& t, const OpCall& op, const Args& a,
                      const std::vector<char*>& bufs);
// Every rank but the root copies the root's buffer into its own (a.out), once.
void broadcast_zero_copy(Transport& t, const OpCall& op, const Args& a,
                         const std::vector<char*>& bufs);

}  // namespace pycomm
