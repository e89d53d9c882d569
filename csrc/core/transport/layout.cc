#include "core/transport/layout.h"

#include <algorithm>
#include <cstddef>

namespace pycomm {
namespace {

constexpr size_t kPage = 4096;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// A rank's hot counters must not share a cache line with anything a peer reads on every
// op (layout.h, RankControl): one such line costs a core-to-core transfer per op.
constexpr size_t line_of(size_t offset) { return offset / kLine; }
static_assert(line_of(offsetof(RankControl, cpu)) != line_of(offsetof(RankControl, pid_ns)));
static_assert(line_of(offsetof(RankControl, entered_seq)) != line_of(offsetof(RankControl, cpu)));
static_assert(line_of(offsetof(RankControl, completed_seq)) !=
              line_of(offsetof(RankControl, recent) + sizeof(RankControl::recent) - 1));
static_assert(line_of(offsetof(RankControl, stage)) !=
              line_of(offsetof(RankControl, completed_seq)));
static_assert(line_of(offsetof(RankControl, bells)) != line_of(offsetof(RankControl, stage)));
static_assert(sizeof(Bell) == kLine && sizeof(DirectHeader) == kLine);

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

Layout::Layout(int world, const GroupSettings& s) : world_(world), slots_(s.slots) {
  const size_t slot_bytes = s.slot_bytes, direct_bytes = s.direct_bytes;
  // Whole pages, so reserving one buffer never allocates a neighbour's page.
  descs_bytes_ = round_up(s.slots * sizeof(SlotHeader), kPage);
  buffer_stride_ = round_up(slot_bytes, kPage);
  channel_stride_ = descs_bytes_ + s.slots * buffer_stride_;
  // At least 256 bytes: zero-copy negotiation posts its offers here even when the
  // direct algorithm itself is turned off.
  direct_stride_ = sizeof(DirectHeader) + round_up(std::max<size_t>(direct_bytes, 256), kLine);
  const size_t nchannels = 2 * static_cast<size_t>(world) * (world - 1);
  controls_off_ = round_up(sizeof(SegmentHeader), kPage);
  ctls_off_ = round_up(controls_off_ + world * sizeof(RankControl), kPage);
  direct_off_ = round_up(ctls_off_ + nchannels * sizeof(ChannelCtl), kPage);
  payloads_off_ = round_up(direct_off_ + 2 * static_cast<size_t>(world) * direct_stride_, kPage);
  stages_off_ = payloads_off_ + nchannels * channel_stride_;
  stage_piece_ = s.two_shot_bytes != 0 ? s.two_shot_piece_bytes : 0;
  stage_stride_ = round_up(2 * stage_piece_, kPage);
  total_ = stages_off_ + 2 * static_cast<size_t>(world) * stage_stride_;
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

size_t Layout::channel_offset(Lane lane, int src, int dst) const {
  return ctls_off_ + channel_index(lane, src, dst) * sizeof(ChannelCtl);
}

ChannelCtl* Layout::channel(void* base, Lane lane, int src, int dst) const {
  return reinterpret_cast<ChannelCtl*>(static_cast<char*>(base) + channel_offset(lane, src, dst));
}

Extent Layout::channel_extent(Lane lane, int src, int dst) const {
  return {payloads_off_ + channel_index(lane, src, dst) * channel_stride_, channel_stride_};
}

Extent Layout::channel_head(Lane lane, int src, int dst, uint32_t buffers) const {
  return {channel_extent(lane, src, dst).offset, descs_bytes_ + buffers * buffer_stride_};
}

size_t Layout::first_channel_bytes() const {
  return descs_bytes_ + std::min(kFirstBuffers, slots_) * buffer_stride_;
}

Extent Layout::buffer_extent(Lane lane, int src, int dst, uint32_t b) const {
  return {channel_extent(lane, src, dst).offset + descs_bytes_ + b * buffer_stride_,
          buffer_stride_};
}

SlotHeader* Layout::slot(void* base, Lane lane, int src, int dst, uint64_t index) const {
  auto* p = static_cast<char*>(base) + channel_extent(lane, src, dst).offset +
            (index % slots_) * sizeof(SlotHeader);
  return reinterpret_cast<SlotHeader*>(p);
}

void* Layout::buffer(void* base, Lane lane, int src, int dst, uint32_t b) const {
  return static_cast<char*>(base) + buffer_extent(lane, src, dst, b).offset;
}

DirectHeader* Layout::direct(void* base, int rank, int parity) const {
  auto* p = static_cast<char*>(base) + direct_off_ +
            (2 * static_cast<size_t>(rank) + parity) * direct_stride_;
  return reinterpret_cast<DirectHeader*>(p);
}

char* Layout::stage(void* base, int rank, int parity) const {
  return static_cast<char*>(base) + stages_off_ +
         (2 * static_cast<size_t>(rank) + parity) * stage_stride_;
}

Extent Layout::stage_extent(int rank) const {
  return {stages_off_ + 2 * static_cast<size_t>(rank) * stage_stride_, 2 * stage_stride_};
}

}  // namespace pycomm
