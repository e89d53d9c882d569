#include "core/transport/layout.h"

#include <algorithm>

namespace pycomm {
namespace {

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

}  // namespace

void PackedDesc::store(const OpDesc& d) {
  w[0].store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  w[1].store((static_cast<uint64_t>(d.kind) << 32) | static_cast<uint32_t>(d.dtype),
             std::memory_order_relaxed);
  w[2].store(d.count, std::memory_order_relaxed);
  w[3].store((static_cast<uint64_t>(d.op) << 32) | static_cast<uint32_t>(d.root),
             std::memory_order_relaxed);
  w[0].store(d.seq, std::memory_order_release);
}

bool PackedDesc::load(uint64_t seq, OpDesc* out) const {
  if (w[0].load(std::memory_order_acquire) != seq) return false;
  uint64_t w1 = w[1].load(std::memory_order_relaxed);
  uint64_t w2 = w[2].load(std::memory_order_relaxed);
  uint64_t w3 = w[3].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (w[0].load(std::memory_order_relaxed) != seq) return false;
  out->seq = seq;
  out->kind = static_cast<OpKind>(w1 >> 32);
  out->dtype = static_cast<DType>(w1 & 0xFFFFFFFFu);
  out->count = w2;
  out->op = static_cast<RedOp>(w3 >> 32);
  out->root = static_cast<int32_t>(w3 & 0xFFFFFFFFu);
  return true;
}

Layout::Layout(int world, uint32_t slots, size_t slot_bytes, size_t direct_bytes)
    : world_(world), slots_(slots) {
  slot_stride_ = sizeof(SlotHeader) + round_up(slot_bytes, kLine);
  channel_stride_ = sizeof(ChannelCtl) + slots * slot_stride_;
  // At least 256 bytes: zero-copy negotiation posts its offers here even when the
  // direct algorithm itself is turned off.
  direct_stride_ = sizeof(DirectHeader) + round_up(std::max<size_t>(direct_bytes, 256), kLine);
  controls_off_ = round_up(sizeof(SegmentHeader), 4096);
  channels_off_ = round_up(controls_off_ + world * sizeof(RankControl), 4096);
  size_t nchannels = 2 * static_cast<size_t>(world) * (world - 1);
  direct_off_ = round_up(channels_off_ + nchannels * channel_stride_, 4096);
  total_ = round_up(direct_off_ + 2 * static_cast<size_t>(world) * direct_stride_, 4096);
}

RankControl* Layout::control(void* base, int rank) const {
  auto* p = static_cast<char*>(base) + controls_off_ + rank * sizeof(RankControl);
  return reinterpret_cast<RankControl*>(p);
}

// Channels to self do not exist: (src, dst) maps onto world - 1 entries per src.
size_t Layout::channel_index(Lane lane, int src, int dst) const {
  size_t per_lane = static_cast<size_t>(world_) * (world_ - 1);
  size_t d = dst < src ? dst : dst - 1;
  return lane * per_lane + static_cast<size_t>(src) * (world_ - 1) + d;
}

ChannelCtl* Layout::channel(void* base, Lane lane, int src, int dst) const {
  auto* p =
      static_cast<char*>(base) + channels_off_ + channel_index(lane, src, dst) * channel_stride_;
  return reinterpret_cast<ChannelCtl*>(p);
}

SlotHeader* Layout::slot(void* base, Lane lane, int src, int dst, uint64_t index) const {
  auto* p = reinterpret_cast<char*>(channel(base, lane, src, dst)) + sizeof(ChannelCtl) +
            (index % slots_) * slot_stride_;
  return reinterpret_cast<SlotHeader*>(p);
}

DirectHeader* Layout::direct(void* base, int rank, int parity) const {
  auto* p = static_cast<char*>(base) + direct_off_ +
            (2 * static_cast<size_t>(rank) + parity) * direct_stride_;
  return reinterpret_cast<DirectHeader*>(p);
}

}  // namespace pycomm
