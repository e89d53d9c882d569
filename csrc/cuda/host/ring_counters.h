// The CUDA-IPC ring's host counters: one small shared-memory segment per ring that every
// rank maps. The GPU data moves through CUDA IPC; this segment only orders the enqueueing
// (which steps each rank has posted and read), says what each rank called, and carries
// the job's abort record.
//
//   RingHeader | RingRank x world
//
// Every field of a RingRank but its doorbell is written by its own rank only (peers read
// it); the doorbell (its own cache line) and the header's `failed_by` are the shared words.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/transport/layout.h"

namespace pycomm {

constexpr uint64_t kRingMagic = 0x31676e6972616463ull;  // "cdaring1"
// Config caps PYCOMM_CUDA_SLOTS at 64: every rank's segment has room for that many tags,
// so its size does not depend on a setting the ranks might not share.
constexpr int kMaxRingSlots = 64;
constexpr int kRingHistory = 4;  // descriptors of a rank's last calls, by seq % 4

// What a rank is doing with the ring, for liveness checks and teardown.
enum class RingRankState : uint32_t {
  ABSENT = 0,   // not mapped yet (reads as alive: it may still be joining)
  JOINED = 1,   // holds its liveness lock; gone without leaving = died
  DRAINED = 2,  // left after its device work finished (nothing of it reads peers' windows)
  LEFT = 3,     // left without knowing its device work finished
};

// Which step of which call a window slot holds. Written before the step is posted; the
// reader checks it before reading the slot, so a predecessor that walks another plan
// over the same step numbers is caught instead of read.
struct RingSlotTag {
  std::atomic<uint64_t> step_plus_1{0};  // 0: never written
  PackedDesc call;
};

// A rank's reason for failing the job, written once, before the header points at it:
// a reader that sees `failed_by` sees the whole text.
struct RingNote {
  std::atomic<uint32_t> state{0};  // 0 empty, 1 being written, 2 written
  char why[1020];
};

struct alignas(kLine) RingHeader {
  uint64_t magic;
  int32_t world;
  uint32_t slots;
  std::atomic<uint32_t> failed_by{0};  // 0: the job is fine; r + 1: rank r's note says why
};

struct alignas(kLine) RingRank {
  std::atomic<uint32_t> state{0};        // RingRankState
  std::atomic<uint64_t> entered_seq{0};  // the last call this rank started
  std::atomic<uint64_t> posted{0};       // its steps < posted are enqueued
  std::atomic<uint64_t> read_prev{0};    // it has enqueued its reads of the predecessor's
                                         // steps < read_prev
  alignas(kLine) PackedDesc recent[kRingHistory];
  alignas(kLine) RingSlotTag window[kMaxRingSlots];
  alignas(kLine) RingNote note;
  // Rung by whoever changes something this rank may wait for: its predecessor posting,
  // its successor reading, any rank failing the job or leaving.
  Bell bell;
};

inline size_t ring_counters_bytes(int world) {
  return sizeof(RingHeader) + static_cast<size_t>(world) * sizeof(RingRank);
}

inline RingHeader* ring_header(void* base) { return static_cast<RingHeader*>(base); }

inline RingRank* ring_rank(void* base, int rank) {
  return reinterpret_cast<RingRank*>(static_cast<char*>(base) + sizeof(RingHeader)) + rank;
}

}  // namespace pycomm
