// All-to-all, gather and scatter over the full mesh of channels.
#include <algorithm>
#include <cstring>

#include "algorithms.h"

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
