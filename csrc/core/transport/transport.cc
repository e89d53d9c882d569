#include "core/transport/transport.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/communicator/faults.h"

namespace pycomm {

Transport::Transport(const Shared& shared, Lane lane, Waiter& waiter)
    : shared_(shared),
      lane_(lane),
      waiter_(waiter),
      chunk_bytes_(shared.header()->settings.slot_bytes),
      slots_(shared.header()->settings.slots),
      sent_(shared.world(), 0),
      received_(shared.world(), 0),
      out_(shared.world()),
      finished_(shared.world(), 0) {}

// ---- channels ----------------------------------------------------------------------------

void Transport::reserve(int peer) {
  Outbox& o = out_[peer];
  if (o.reserved != 0) return;
  const uint32_t first = std::min(kFirstBuffers, slots_);
  shared_.reserve_channel(lane_, peer, first);
  o.reserved = first;
}

void Transport::retire(int peer) {
  Outbox& o = out_[peer];
  ChannelCtl* ch = shared_.layout().channel(shared_.base(), lane_, rank(), peer);
  // The receiver releases what was sent, in order: never more, never back.
  const uint64_t tail = ch->tail.load(std::memory_order_acquire);
  if (tail > sent_[peer] || tail < o.retired) {
    implausible_channel(rank(), peer, peer, "tail", tail, o.retired, sent_[peer]);
  }
  for (; o.retired < tail; ++o.retired) o.busy &= ~(uint64_t{1} << o.buffer_of[o.retired % slots_]);
}

// Room for one more message: a free descriptor and a free buffer, growing the channel by
// a buffer when every one it has is in flight (its receiver is behind) and /dev/shm has
// room to spare.
bool Transport::can_acquire(int peer) {
  reserve(peer);
  retire(peer);
  Outbox& o = out_[peer];
  const uint64_t in_flight = sent_[peer] - o.retired;
  if (in_flight >= slots_) return false;
  if (in_flight < o.reserved) return true;
  if (o.full) return false;
  if (!shared_.try_reserve_buffer(lane_, peer, o.reserved)) {
    o.full = true;
    return false;
  }
  ++o.reserved;
  return true;
}

// The lowest-numbered free buffer: a sender its receiver keeps up with reuses the first
// few, still in cache, whatever the channel's depth.
uint32_t Transport::free_buffer(int peer) {
  Outbox& o = out_[peer];
  const uint64_t usable = o.reserved >= 64 ? ~uint64_t{0} : (uint64_t{1} << o.reserved) - 1;
  o.chosen = static_cast<uint32_t>(__builtin_ctzll(~o.busy & usable));
  return o.chosen;
}

void* Transport::slot_payload_for_send(int peer) {
  return shared_.layout().buffer(shared_.base(), lane_, rank(), peer, free_buffer(peer));
}

void* Transport::acquire(int peer, const OpCall& op) {
  waiter_.wait(
      op, [&] { return can_acquire(peer); }, [&](std::vector<int>& who) { who.push_back(peer); });
  return slot_payload_for_send(peer);
}

void Transport::publish(int peer, const OpCall& op, uint64_t offset, uint64_t bytes,
                        uint64_t msg_bytes) {
  Outbox& o = out_[peer];
  ChannelCtl* ch = shared_.layout().channel(shared_.base(), lane_, rank(), peer);
  SlotHeader* h = shared_.layout().slot(shared_.base(), lane_, rank(), peer, sent_[peer]);
  h->desc = op.desc;
  h->offset = offset;
  h->bytes = bytes;
  h->msg_bytes = msg_bytes;
  h->buffer = o.chosen + Faults::buffer_skew.load(std::memory_order_relaxed);
  o.busy |= uint64_t{1} << o.chosen;
  o.buffer_of[sent_[peer] % slots_] = static_cast<uint8_t>(o.chosen);
  ch->head.store(++sent_[peer], std::memory_order_release);
  shared_.ring(peer, lane_);
}

const SlotHeader* Transport::peek(int peer) const {
  ChannelCtl* ch = shared_.layout().channel(shared_.base(), lane_, peer, rank());
  const uint64_t head = ch->head.load(std::memory_order_acquire);
  if (head == received_[peer]) return nullptr;
  // The sender publishes in order, at most a channel's slots ahead of what was released.
  if (head < received_[peer] || head - received_[peer] > slots_) {
    implausible_channel(peer, rank(), peer, "head", head, received_[peer],
                        received_[peer] + slots_);
  }
  return shared_.layout().slot(shared_.base(), lane_, peer, rank(), received_[peer]);
}

const void* Transport::receive(int peer, const OpCall& op, uint64_t offset, uint64_t bytes,
                               uint64_t msg_bytes) {
  const SlotHeader* h = peek(peer);
  if (h == nullptr) {
    waiter_.wait(
        op, [&] { return (h = peek(peer)) != nullptr; },
        [&](std::vector<int>& who) { who.push_back(peer); });
  }
  bool same = h->desc.seq == op.desc.seq && same_call(h->desc, op.desc) && h->offset == offset &&
              h->bytes == bytes && h->msg_bytes == msg_bytes;
  if (!same) chunk_mismatch(peer, op, *h, offset, bytes, msg_bytes);
  return payload(peer, *h);
}

const void* Transport::payload(int peer, const SlotHeader& h) const {
  if (h.buffer >= slots_) {
    waiter_.fail("pycomm: rank " + std::to_string(peer) + " sent rank " + std::to_string(rank()) +
                 " a chunk of " + describe(h.desc) + " in buffer " + std::to_string(h.buffer) +
                 " of a channel of " + std::to_string(slots_) +
                 " (a corrupted or foreign segment)");
  }
  return shared_.layout().buffer(shared_.base(), lane_, peer, rank(), h.buffer);
}

void Transport::release(int peer) {
  ChannelCtl* ch = shared_.layout().channel(shared_.base(), lane_, peer, rank());
  ch->tail.store(++received_[peer], std::memory_order_release);
  shared_.ring(peer, lane_);
}

void Transport::chunk_mismatch(int peer, const OpCall& op, const SlotHeader& h, uint64_t offset,
                               uint64_t bytes, uint64_t msg_bytes) {
  std::string me = std::to_string(rank());
  std::string them = std::to_string(peer);
  // (A header of another seq is a disagreement: a rank that called another op may not
  // have sent this rank anything at this seq.)
  if (!publishable(h.desc)) waiter_.fail(unpublishable(peer, "message header", h.desc));
  if (h.desc.seq != op.desc.seq || !same_call(h.desc, op.desc)) {
    waiter_.fail("pycomm: ranks disagree at seq " + std::to_string(op.desc.seq) + ": rank " + me +
                 " called " + describe(op.desc) + " but rank " + them + " sent " +
                 describe(h.desc) + " (its seq " + std::to_string(h.desc.seq) + ")");
  }
  waiter_.fail("pycomm: " + where(op, rank()) + ": rank " + them + " sends " +
               std::to_string(h.msg_bytes) + " bytes (chunk at " + std::to_string(h.offset) + ", " +
               std::to_string(h.bytes) + " bytes) but rank " + me + " expects " +
               std::to_string(msg_bytes) + " bytes (chunk at " + std::to_string(offset) + ", " +
               std::to_string(bytes) + " bytes)");
}

// ---- direct areas ------------------------------------------------------------------------

template <class Behind>
void Transport::wait_for_peers(const OpCall& op, Behind behind) {
  waiter_.wait(
      op,
      [&] {
        for (int r = 0; r < world(); ++r)
          if (r != rank() && behind(r)) return false;
        return true;
      },
      [&](std::vector<int>& who) {
        for (int r = 0; r < world(); ++r)
          if (r != rank() && behind(r)) who.push_back(r);
      });
}

// The areas for this parity were last used at seq - 2; peers may still read them until
// they have finished that op.
void Transport::wait_parity_free(const OpCall& op) {
  uint64_t seq = op.desc.seq;
  if (seq <= 2) return;
  int bad = -1;  // reported after the wait, not thrown from inside it
  wait_for_peers(op, [&](int r) { return !peer_finished(r, seq - 2, op, &bad); });
  if (bad >= 0) implausible(bad, op, "completed_seq", bad_count_, seq + kMostLead);
}

void* Transport::direct_buffer(const OpCall& op) {
  wait_parity_free(op);
  return Layout::payload(shared_.layout().direct(shared_.base(), rank(), op.desc.seq & 1));
}

char* Transport::stage_area(const OpCall& op) {
  if (!stage_reserved_) {
    shared_.reserve_stage_areas();
    stage_reserved_ = true;
  }
  wait_parity_free(op);
  return shared_.layout().stage(shared_.base(), rank(), op.desc.seq & 1);
}

const char* Transport::peer_stage_area(int peer, const OpCall& op) const {
  return shared_.layout().stage(shared_.base(), peer, op.desc.seq & 1);
}

// Whether `peer` has finished collective `seq`. What this rank has seen of it answers
// without touching the peer's counters in the common case (see wait_direct). A peer
// leads this rank (in op) by at most the ops its channels buffer (PYCOMM_SLOTS <= 64):
// a larger count is no peer's progress, and taking it would reuse areas it still reads.
bool Transport::peer_finished(int peer, uint64_t seq, const OpCall& op, int* bad) {
  uint64_t& known = finished_[peer];
  if (known < seq) {
    const uint64_t read = shared_.control(peer)->completed_seq.load(std::memory_order_acquire);
    if (read > op.desc.seq + kMostLead) {
      if (*bad < 0) *bad = peer;
      bad_count_ = read;
      return true;
    }
    known = read;
  }
  return known >= seq;
}

void Transport::implausible(int peer, const OpCall& op, const char* counter, uint64_t value,
                            uint64_t bound) {
  waiter_.fail("pycomm: " + describe(op.desc) + " (seq " + std::to_string(op.desc.seq) +
               "): rank " + std::to_string(peer) + "'s " + counter + " reads " +
               std::to_string(value) + ", beyond what a peer of this op can publish (" +
               std::to_string(bound) +
               "): the group's shared segment was written by "
               "something other than pycomm");
}

void Transport::implausible_channel(int src, int dst, int writer, const char* counter,
                                    uint64_t value, uint64_t low, uint64_t high) const {
  waiter_.fail("pycomm: the " + std::string(lane_ == COLL ? "collective" : "send/recv") +
               " channel from rank " + std::to_string(src) + " to rank " + std::to_string(dst) +
               ": rank " + std::to_string(writer) + "'s " + counter + " reads " +
               std::to_string(value) + ", outside what it can have published (" +
               std::to_string(low) + " to " + std::to_string(high) +
               "): the group's shared segment was written by something other than pycomm");
}

void Transport::post_direct(const OpCall& op) {
  DirectHeader* h = shared_.layout().direct(shared_.base(), rank(), op.desc.seq & 1);
  h->desc = op.desc;
  h->ready_seq.store(op.desc.seq, std::memory_order_release);
  shared_.ring_others(lane_);
}

const void* Transport::wait_direct(int peer, const OpCall& op) {
  DirectHeader* h = shared_.layout().direct(shared_.base(), peer, op.desc.seq & 1);
  auto ready = [&] { return h->ready_seq.load(std::memory_order_acquire) == op.desc.seq; };
  if (!ready()) {
    waiter_.wait(op, ready, [&](std::vector<int>& who) { who.push_back(peer); });
  }
  if (!publishable(h->desc) || h->desc.seq != op.desc.seq) {
    waiter_.fail(unpublishable(peer, "direct buffer's descriptor", h->desc));
  }
  if (!same_call(h->desc, op.desc)) {
    waiter_.fail("pycomm: ranks disagree at seq " + std::to_string(op.desc.seq) + ": rank " +
                 std::to_string(rank()) + " called " + describe(op.desc) + " but rank " +
                 std::to_string(peer) + " called " + describe(h->desc));
  }
  // A rank runs its collectives one at a time: having started seq, it finished seq - 1.
  finished_[peer] = std::max(finished_[peer], op.desc.seq - 1);
  return h + 1;
}

// ---- steps -------------------------------------------------------------------------------

void Transport::post_stage(const OpCall& op, uint64_t k) {
  shared_.control(rank())->stage.store(op.desc.seq * kStagesPerOp + k, std::memory_order_release);
  shared_.ring_others(lane_);
}

void Transport::wait_stage(const OpCall& op, uint64_t k) {
  const uint64_t want = op.desc.seq * kStagesPerOp + k;
  // A peer runs ahead of this rank by the ops its channels buffer at most (as with
  // completed_seq: kMostLead); a counter beyond is no peer's progress, and following it
  // would read a stage area the peer has not filled. It is reported after the wait (not
  // thrown from inside it), which it ends: the waiting stops at the first such read.
  const uint64_t beyond = (op.desc.seq + kMostLead) * kStagesPerOp;
  int bad = -1;
  uint64_t seen = 0;
  wait_for_peers(op, [&](int r) {
    const uint64_t s = shared_.control(r)->stage.load(std::memory_order_acquire);
    if (s >= beyond && bad < 0) bad = r, seen = s;
    return bad < 0 && s < want;
  });
  if (bad >= 0) implausible(bad, op, "stage", seen, beyond - 1);
}

}  // namespace pycomm
