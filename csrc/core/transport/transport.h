// The shared-memory transport that algorithms are written against: channels of
// fixed-size slots to each peer, and per-rank direct areas for small messages.
// Everything here waits through the Waiter, so no wait can outlive the op's deadline.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/communicator/waiter.h"
#include "core/transport/shared_state.h"

namespace pycomm {

class Transport {
 public:
  Transport(const Shared& shared, Lane lane, Waiter& waiter);

  int rank() const { return shared_.rank(); }
  int world() const { return shared_.world(); }
  size_t chunk_bytes() const { return chunk_bytes_; }

  // ---- channels ----------------------------------------------------------------------
  // Waits for a free slot towards `peer` and returns its buffer (chunk_bytes() long).
  void* acquire(int peer, const OpCall& op);
  // Hands the slot filled since acquire() to `peer`; the header says what it holds.
  void publish(int peer, const OpCall& op, uint64_t offset, uint64_t bytes, uint64_t msg_bytes);
  // Waits for the next slot from `peer` and checks that it holds exactly the chunk this
  // rank expects (same call, same place, same size); returns its payload.
  const void* receive(int peer, const OpCall& op, uint64_t offset, uint64_t bytes,
                      uint64_t msg_bytes);
  // Gives the slot returned by receive() back to `peer`.
  void release(int peer);
  // The payload of a slot from `peer` (peek()'s), once its buffer number is checked.
  const void* payload(int peer, const SlotHeader& h) const;

  // Waits, as every wait here does, until ready() holds; `peer` is the rank it depends on.
  template <class Ready>
  void wait_for(const OpCall& op, int peer, Ready ready) {
    waiter_.wait(op, ready, [&](std::vector<int>& who) { who.push_back(peer); });
  }

  // Non-blocking forms, for the send/recv engine. can_acquire() may reserve another
  // buffer of the channel (the receiver is behind and /dev/shm has room).
  bool can_acquire(int peer);
  void* slot_payload_for_send(int peer);
  const SlotHeader* peek(int peer) const;  // the next unreleased slot from peer, or null

  // ---- direct areas (collective lane only) ---------------------------------------------
  // This rank's area for op's sequence number, once every peer is done with its last use.
  void* direct_buffer(const OpCall& op);
  void post_direct(const OpCall& op);
  // Waits until `peer` has posted for this op and checks it called the same thing.
  const void* wait_direct(int peer, const OpCall& op);

  // ---- stage areas (collective lane only; the two-shot algorithms) ---------------------
  // This rank's area for op's sequence number (two pieces of stage_piece_bytes()), once
  // every peer is done with its last use; reserved in /dev/shm the first time.
  char* stage_area(const OpCall& op);
  // `peer`'s area for op's sequence number; read it only after a step the peer posted.
  const char* peer_stage_area(int peer, const OpCall& op) const;
  size_t stage_piece_bytes() const { return shared_.layout().stage_piece_bytes(); }

  // ---- steps within one op (collective lane only) ---------------------------------------
  // Announces that this rank finished step `k` (1 .. 2^20 - 1) of op; wait_stage()
  // returns once every other rank has too.
  static constexpr uint64_t kStagesPerOp = 1ull << 20;
  // How many collectives a peer can have finished beyond the one this rank runs: its
  // channels buffer PYCOMM_SLOTS (<= 64) ops at most; anything near this is corruption.
  static constexpr uint64_t kMostLead = 1ull << 16;
  void post_stage(const OpCall& op, uint64_t k);
  void wait_stage(const OpCall& op, uint64_t k);

 private:
  // Waits until behind(r) is false for every other rank r.
  template <class Behind>
  void wait_for_peers(const OpCall& op, Behind behind);
  // Whether `peer` finished collective `seq`; sets *bad to `peer` (and answers true, to
  // end a wait) where its counter is beyond what a peer of op could publish.
  bool peer_finished(int peer, uint64_t seq, const OpCall& op, int* bad);
  // A peer's counter that no peer running this op could have published (the segment
  // was written by something other than pycomm): fails the job naming it.
  [[noreturn]] void implausible(int peer, const OpCall& op, const char* counter, uint64_t value,
                                uint64_t bound);
  // The same for a counter of the channel from `src` to `dst` outside [low, high]:
  // head (the sender's) or tail (the receiver's); `writer` is the rank that writes it.
  [[noreturn]] void implausible_channel(int src, int dst, int writer, const char* counter,
                                        uint64_t value, uint64_t low, uint64_t high) const;
  // Waits until every peer has finished the op before the last one that used this
  // rank's areas of op's parity (seq - 2).
  void wait_parity_free(const OpCall& op);

  // What this rank, as a sender, knows of its channel to one peer.
  struct Outbox {
    uint32_t reserved = 0;    // buffers allocated in /dev/shm (0: the channel is not yet)
    bool full = false;        // /dev/shm had no room for another: stop trying
    uint64_t busy = 0;        // bit b: buffer b holds a message not yet released
    uint64_t retired = 0;     // messages whose buffers `busy` no longer counts
    uint32_t chosen = 0;      // the buffer acquire() handed out, for publish()
    uint8_t buffer_of[64]{};  // message index % slots -> its buffer
  };
  bool stage_reserved_ = false;
  // The channel to `peer` is reserved in /dev/shm on first use (see layout.h).
  void reserve(int peer);
  // Frees the buffers of messages the receiver has released since last asked.
  void retire(int peer);
  uint32_t free_buffer(int peer);  // after can_acquire(): the lowest free buffer
  [[noreturn]] void chunk_mismatch(int peer, const OpCall& op, const SlotHeader& h, uint64_t offset,
                                   uint64_t bytes, uint64_t msg_bytes);

  const Shared& shared_;
  Lane lane_;
  Waiter& waiter_;
  size_t chunk_bytes_;
  uint32_t slots_;
  std::vector<uint64_t> sent_;      // messages published to each peer (our copy of head)
  std::vector<uint64_t> received_;  // messages released from each peer (our copy of tail)
  std::vector<Outbox> out_;         // our channel to each peer
  std::vector<uint64_t> finished_;  // the last collective each peer is known to have finished
  uint64_t bad_count_ = 0;          // the implausible counter peer_finished last read
};

}  // namespace pycomm
