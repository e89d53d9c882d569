// All-to-all, gather and scatter over the full mesh of channels.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>

#include "core/algorithms/algorithms.h"
#include "core/algorithms/all_to_all_offer.h"
#include "core/base/errors.h"
#include "core/communicator/faults.h"
#include "core/memory/arena.h"
#include "core/transport/peer_memory.h"

namespace pycomm {
namespace {

// Moves one message to `to` and one from `from` at the same time, alternating slot by
// slot, so that two ranks sending to each other never wait on each other's full slots.
void exchange(Transport& t, const OpCall& op, int to, const char* src, size_t send_bytes, int from,
              char* dst, size_t recv_bytes) {
  const size_t chunk = t.chunk_bytes();
  size_t sent = 0, got = 0;
  bool send_left = to >= 0, recv_left = from >= 0;
  while (send_left || recv_left) {
    if (send_left) {
      size_t n = std::min(chunk, send_bytes - sent);
      std::memcpy(t.acquire(to, op), src + sent, n);
      t.publish(to, op, sent, n, send_bytes);
      sent += n;
      send_left = sent < send_bytes;
    }
    if (recv_left) {
      size_t n = std::min(chunk, recv_bytes - got);
      std::memcpy(dst + got, t.receive(from, op, got, n, recv_bytes), n);
      t.release(from);
      got += n;
      recv_left = got < recv_bytes;
    }
  }
}

}  // namespace

// Step d (1..n-1): send to rank r+d while receiving from rank r-d, so every step pairs
// each sender with a receiver that is in the same step.
void all_to_all_pairwise(Transport& t, const OpCall& op, const AllToAllArgs& a) {
  const int n = t.world(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  const auto* in = static_cast<const char*>(a.in);
  auto* out = static_cast<char*>(a.out);
  std::memmove(out + a.recv_offsets[r] * es, in + a.send_offsets[r] * es, a.send_counts[r] * es);
  for (int d = 1; d < n; ++d) {
    int to = (r + d) % n, from = (r - d + n) % n;
    exchange(t, op, to, in + a.send_offsets[to] * es, a.send_counts[to] * es, from,
             out + a.recv_offsets[from] * es, a.recv_counts[from] * es);
  }
}

namespace {

// The extent of a's input: the end of its furthest block, in bytes.
size_t input_bytes(const AllToAllArgs& a) {
  size_t end = 0;
  for (size_t q = 0; q < a.send_counts.size(); ++q)
    end = std::max(end, a.send_offsets[q] + a.send_counts[q]);
  return end * dtype_size(a.dtype);
}

// Whether `from` lets `to` read its blocks in place (both decide it alike).
bool pulls(const AllToAllOffer& from, const AllToAllOffer& to) {
  return from.pull_me && from.pid_ns != 0 && from.pid_ns == to.pid_ns;
}

// Where `b` lies in `from`'s input, as mapped here; its extent is checked against the
// slab (overflow-safe: the block table comes from the peer).
const char* pulled_block(PeerMemory& peers, int from, const AllToAllOffer& theirs,
                         const AllToAllOffer::Block& b, size_t es, int me) {
  uint64_t begin, count, end;
  if (__builtin_mul_overflow(b.offset, es, &begin) || __builtin_mul_overflow(b.count, es, &count) ||
      __builtin_add_overflow(begin, count, &end)) {
    throw CommError("pycomm: all_to_all: rank " + std::to_string(from) +
                    " posted a block for rank " + std::to_string(me) + " whose bytes overflow (" +
                    std::to_string(b.offset) + " + " + std::to_string(b.count) + " elements)");
  }
  return peers.resolve(from, theirs.where, end) + begin;
}

}  // namespace

size_t all_to_all_offer_bytes(int world) {
  return offsetof(AllToAllOffer, blocks) + world * sizeof(AllToAllOffer::Block);
}

AllToAllOffer* fill_all_to_all_offer(Transport& t, const OpCall& op, const AllToAllArgs& a,
                                     bool may_pull) {
  const int n = t.world();
  auto* mine = static_cast<AllToAllOffer*>(t.direct_buffer(op));
  const size_t in_bytes = input_bytes(a);
  ArenaLocation where;
  mine->pull_me = may_pull && in_bytes > 0 && Arena::instance().locate(a.in, in_bytes, &where);
  mine->where = posted(where);
  mine->world = static_cast<uint32_t>(n);
  mine->pid_ns = pid_namespace_id();
  for (int q = 0; q < n; ++q) mine->blocks[q] = {a.send_offsets[q], a.send_counts[q]};
  return mine;
}

int move_all_to_all_blocks(Transport& t, PeerMemory& peers, const OpCall& op, const AllToAllArgs& a,
                           const AllToAllOffer& mine) {
  const int n = t.world(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  const auto* in = static_cast<const char*>(a.in);
  auto* out = static_cast<char*>(a.out);
  std::memmove(out + a.recv_offsets[r] * es, in + a.send_offsets[r] * es, a.send_counts[r] * es);
  int pulled = 0;
  bool pulled_from_me = false;
  for (int d = 1; d < n; ++d) {
    const int to = (r + d) % n, from = (r - d + n) % n;
    const auto* theirs = static_cast<const AllToAllOffer*>(t.wait_direct(from, op));
    const auto* receiver = static_cast<const AllToAllOffer*>(t.wait_direct(to, op));
    char* dst = out + a.recv_offsets[from] * es;
    const bool pull = pulls(*theirs, mine);
    if (pull) {
      const AllToAllOffer::Block b = theirs->blocks[r];
      if (b.count != a.recv_counts[from]) {
        throw InvalidArgument("pycomm: all_to_all: rank " + std::to_string(r) + " expects " +
                              std::to_string(a.recv_counts[from]) + " elements from rank " +
                              std::to_string(from) + ", which sends it " + std::to_string(b.count));
      }
      std::memcpy(dst, pulled_block(peers, from, *theirs, b, es, r), b.count * es);
      ++pulled;
    }
    // Whoever pulls from us is not sent to; whoever offers is not received from.
    const bool pulled_by_to = pulls(mine, *receiver);
    pulled_from_me = pulled_from_me || pulled_by_to;
    exchange(t, op, pulled_by_to ? -1 : to, in + a.send_offsets[to] * es, a.send_counts[to] * es,
             pull ? -1 : from, dst, a.recv_counts[from] * es);
  }
  // Nobody returns (and lets its input change) while a peer may still be reading it.
  t.post_stage(op, 1);
  if (pulled_from_me) t.wait_stage(op, 1);
  return pulled;
}

int all_to_all_pull(Transport& t, PeerMemory& peers, const OpCall& op, const AllToAllArgs& a) {
  const AllToAllOffer* mine = fill_all_to_all_offer(t, op, a, true);
  t.post_direct(op);
  return move_all_to_all_blocks(t, peers, op, a, *mine);
}

void gather_to_root(Transport& t, const OpCall& op, const Args& a) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  if (t.rank() != a.root) {
    exchange(t, op, a.root, static_cast<const char*>(a.in), bytes, -1, nullptr, 0);
    return;
  }
  auto* out = static_cast<char*>(a.out);
  std::memcpy(out + a.root * bytes, a.in, bytes);
  for (int r = 0; r < t.world(); ++r) {
    if (r != a.root) exchange(t, op, -1, nullptr, 0, r, out + r * bytes, bytes);
  }
}

void scatter_from_root(Transport& t, const OpCall& op, const Args& a) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  if (t.rank() != a.root) {
    exchange(t, op, -1, nullptr, 0, a.root, static_cast<char*>(a.out), bytes);
    return;
  }
  const auto* in = static_cast<const char*>(a.in);
  std::memcpy(a.out, in + a.root * bytes, bytes);
  for (int r = 0; r < t.world(); ++r) {
    if (r != a.root) exchange(t, op, r, in + r * bytes, bytes, -1, nullptr, 0);
  }
}

}  // namespace pycomm
