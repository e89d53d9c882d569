// The shared-memory segment of one communicator, as every rank maps it:
//
//   SegmentHeader | RankControl x world | ChannelCtl x channels | direct areas |
//   '------------------------- reserved at creation --------------------------'
//   channels | stage areas
//   '-- holes, reserved as first used --'
//
// A channel carries messages from one rank to one peer: a single-producer single-consumer
// ring of `slots` descriptors (the sender owns `head`, the receiver `tail`), each naming
// one of `slots` chunk-sized buffers that holds its payload. The sender picks the
// lowest-numbered free buffer, so while its receiver keeps up it cycles through the
// first few, which stay in the two cores' caches; only when the receiver falls behind
// (a rank descheduled by other load) does it reach further, up to `slots` chunks ahead,
// instead of stopping to wait for it.
// Lane COLL serves collectives (run in order by one thread), lane P2P send/recv (run by
// another thread), so a pending recv can never block a collective or the other way round.
// Each rank's direct areas (two, used by alternate sequence numbers) hold a whole small
// message that every peer reads at once. Its stage areas (two likewise, each of two
// pieces) hold what the two-shot algorithms stage; they exist only when the group takes
// it (more than two ranks) and are reserved by their rank when it first does.
//
// There are 2 x world x (world - 1) channels, but a ring only uses world of them and a
// pipeline a few more, so they are holes in the file until a sender first uses one
// (Transport reserves its descriptors and first buffers then, and each further buffer
// when it first needs it): shared memory per rank stays about constant as the world
// grows (a channel's counters, two cache lines, are reserved for all).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/base/types.h"

namespace pycomm {

constexpr uint64_t kSegmentMagic = 0x36766d6d6f637970ull;  // "pycommv6"
constexpr size_t kLine = 64;
// Buffers a channel starts with: as many as a receiver that keeps up ever has in flight
// (the chunk being filled, the one being read, one either side). It grows from there
// only while its receiver is behind.
constexpr uint32_t kFirstBuffers = 4;

enum Lane : int { COLL = 0, P2P = 1 };

// A doorbell a rank sleeps on; anyone who changes something the rank may wait for
// checks `sleepers` and, if the rank is asleep, bumps `seq` and wakes it (Shared::ring).
struct alignas(kLine) Bell {
  std::atomic<uint32_t> seq{0};
  std::atomic<uint32_t> sleepers{0};

  // The sleeper's half of the handshake (Shared::ring is the ringer's): count this
  // thread, then fence, so that a ringer that read `sleepers` before the increment made
  // its change before that read and the caller's re-check sees it. Returns the `seq`
  // futex_wait must compare; done_sleeping() undoes the count.
  uint32_t prepare_sleep() {
    uint32_t seen = seq.load(std::memory_order_seq_cst);
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return seen;
  }
  void done_sleeping() { sleepers.fetch_sub(1, std::memory_order_seq_cst); }
};

// An OpDesc published so that other ranks can read it without locks (a seqlock:
// word 0 holds the sequence number and is written last, cleared first).
struct PackedDesc {
  std::atomic<uint64_t> w[4];
  void store(const OpDesc& d);
  bool load(uint64_t seq, OpDesc* out) const;  // false if it does not hold `seq` (now)
};

// ABSENT until the rank has joined (taken its liveness lock), DEPARTED once it left
// cleanly: a peer that waits for a departed rank says so instead of "died".
// (destroy_process_group), EXITED once its process let go of the group without it.
enum class RankState : uint32_t { ABSENT = 0, ALIVE = 1, DEPARTED = 2, EXITED = 3 };

// One rank's counters. Fields sit on separate cache lines by who writes them and how
// often peers read them: a line this rank writes on every op that a peer also reads on
// every op moves between the two cores each time (100-400 ns on this kind of host, more
// than a whole small all_reduce's data), so no such line is shared with anything hot.
struct alignas(kLine) RankControl {
  // Written when the rank joins and leaves; read by liveness checks.
  std::atomic<int32_t> pid{0};
  std::atomic<uint32_t> state{0};   // RankState
  std::atomic<uint64_t> pid_ns{0};  // inode of /proc/self/ns/pid: pids mean the same
  // The CPU it last started waiting on: written only when that changes, read by every
  // peer that starts to wait (Waiter::shares_cpu_with_a_peer).
  alignas(kLine) std::atomic<int32_t> cpu{-1};
  // Written on every op; read by peers only when a wait is slow (agreement checks,
  // timeout messages).
  alignas(kLine) std::atomic<uint64_t> entered_seq{0};  // last collective this rank started
  PackedDesc recent[4];                                 // descriptors of its last calls, by seq % 4
  // Written on every op; read by a peer about to reuse its direct area, which usually
  // knows the answer already (Transport::peer_finished).
  alignas(kLine) std::atomic<uint64_t> completed_seq{0};  // last collective this rank finished
  alignas(kLine) std::atomic<uint64_t> stage{0};          // seq * 2^20 + step, for multi-step syncs
  Bell bells[2];                                          // one per lane
};

// The group's settings, chosen by rank 0 and read by every rank from here, so ranks
// whose PYCOMM_* differ still run the same algorithms.
struct GroupSettings {
  uint32_t slots;
  uint32_t algo;  // Algo
  uint64_t slot_bytes;
  uint64_t direct_bytes;
  uint32_t zero_copy;  // 0 or 1
  uint32_t stripes;    // 1..kMaxStripes (csrc/torch/backend/stripes.h)
  uint64_t stripe_bytes;
  uint64_t two_shot_bytes;        // 0: the group never takes the two-shot
  uint64_t two_shot_piece_bytes;  // a multiple of 64
};

struct alignas(kLine) SegmentHeader {
  uint64_t magic;
  int32_t world;
  uint32_t pad;
  uint64_t total_bytes;
  GroupSettings settings;
  // The first failure of the job: a rank claims the record (0 -> 1), writes the
  // message, then publishes it (1 -> 2). A rank may die in between, so any non-zero
  // flag means failed; the message is read only once published.
  std::atomic<uint32_t> abort_flag{0};
  int32_t abort_rank;
  char abort_msg[2048];
};

struct alignas(kLine) ChannelCtl {
  alignas(kLine) std::atomic<uint64_t> head{0};  // messages published by the sender
  alignas(kLine) std::atomic<uint64_t> tail{0};  // messages released by the receiver
};

// One message of a channel: who sent what, where the payload belongs, and which of the
// channel's buffers holds it.
struct alignas(kLine) SlotHeader {
  OpDesc desc;
  uint64_t offset;     // byte offset of this chunk within the message
  uint64_t bytes;      // bytes in this chunk
  uint64_t msg_bytes;  // bytes of the whole message
  uint32_t buffer;     // < slots; a receiver checks it (the header is the peer's to write)
};

struct alignas(kLine) DirectHeader {
  std::atomic<uint64_t> ready_seq{0};
  OpDesc desc;
};

// A byte range of the segment.
struct Extent {
  size_t offset = 0;
  size_t bytes = 0;
};

// Offsets of everything in a segment; every rank computes the same from the header.
class Layout {
 public:
  Layout(int world, const GroupSettings& s);

  size_t total_bytes() const { return total_; }
  // The part reserved when the segment is created; the payloads follow it.
  size_t eager_bytes() const { return payloads_off_; }
  size_t controls_offset() const { return controls_off_; }   // rank 0's RankControl
  size_t channel_offset(Lane lane, int src, int dst) const;  // its ChannelCtl
  SegmentHeader* header(void* base) const { return static_cast<SegmentHeader*>(base); }
  RankControl* control(void* base, int rank) const;
  ChannelCtl* channel(void* base, Lane lane, int src, int dst) const;
  uint32_t slots() const { return slots_; }
  // The descriptor of message `index` (counted from 1 by head and tail: index % slots).
  SlotHeader* slot(void* base, Lane lane, int src, int dst, uint64_t index) const;
  // Buffer `b` (< slots) of a channel.
  void* buffer(void* base, Lane lane, int src, int dst, uint32_t b) const;
  // A channel's descriptors and its first `buffers` buffers; and buffer `b` alone
  // (each reserved by the sender when it first needs it).
  Extent channel_head(Lane lane, int src, int dst, uint32_t buffers) const;
  Extent buffer_extent(Lane lane, int src, int dst, uint32_t b) const;
  // The whole of a channel, every buffer reserved.
  Extent channel_extent(Lane lane, int src, int dst) const;
  // What a channel reserves when first used: its descriptors and kFirstBuffers buffers.
  size_t first_channel_bytes() const;
  DirectHeader* direct(void* base, int rank, int parity) const;
  static void* payload(DirectHeader* h) { return h + 1; }
  // A rank's stage area for one parity (two pieces of stage_piece_bytes()), and both of
  // its areas (what it reserves). Empty when the group has no two-shot.
  char* stage(void* base, int rank, int parity) const;
  Extent stage_extent(int rank) const;
  size_t stage_piece_bytes() const { return stage_piece_; }

 private:
  size_t channel_index(Lane lane, int src, int dst) const;

  int world_;
  uint32_t slots_;
  size_t descs_bytes_;     // the descriptors, in whole pages
  size_t buffer_stride_;   // one buffer, in whole pages
  size_t channel_stride_;  // descriptors + buffers
  size_t direct_stride_;
  size_t stage_piece_;   // 0 when the group has no two-shot
  size_t stage_stride_;  // one parity's area: two pieces, in whole pages
  size_t controls_off_, ctls_off_, direct_off_, payloads_off_, stages_off_, total_;
};

}  // namespace pycomm
