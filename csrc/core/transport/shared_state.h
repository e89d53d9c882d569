// One rank's view of the mapped segment: where things are, doorbells, the abort record,
// whether a peer process is still alive, and the reservation of channel payloads.
#pragma once

#include <chrono>
#include <string>

#include "core/base/types.h"
#include "core/base/wait_policy.h"
#include "core/transport/layout.h"
#include "core/transport/liveness.h"
#include "core/transport/shm_segment.h"

namespace pycomm {

// How a rank leaves its group cleanly: by destroy_process_group, or by its process
// dropping the group without it (at exit); peers still waiting are told which.
enum class Departure { DESTROYED, EXITED };

// One running operation, as waits and error messages need to know it.
struct OpCall {
  OpDesc desc;
  Lane lane = COLL;
  Clock::time_point start;
  Clock::time_point deadline;
  double timeout_s = 0;
};

class Shared {
 public:
  Shared(const ShmSegment& segment, const Layout& layout, int rank, int world)
      : segment_(segment), base_(segment.data()), layout_(layout), rank_(rank), world_(world) {}

  int rank() const { return rank_; }
  int world() const { return world_; }
  void* base() const { return base_; }
  const Layout& layout() const { return layout_; }
  SegmentHeader* header() const { return layout_.header(base_); }
  RankControl* control(int r) const { return layout_.control(base_, r); }
  Bell& bell(int r, Lane lane) const { return control(r)->bells[lane]; }

  // Announces this rank to the others: takes its liveness lock, then publishes its
  // pid and PID namespace and marks it alive.
  void join();
  // Marks this rank as having left cleanly (before its lock goes with the segment).
  void depart(Departure how = Departure::DESTROYED);

  // Tells rank r that something it may be waiting for on `lane` has changed.
  void ring(int r, Lane lane) const;
  void ring_others(Lane lane) const;  // every rank but this one
  void ring_everyone(Lane lane) const;

  // The first failure anywhere in the job is recorded once; every rank then raises it.
  bool aborted() const;
  std::string abort_message() const;
  // Records `msg` unless another failure was recorded first; wakes every rank.
  void set_abort(const std::string& msg) const;

  // "" while rank r is alive (or has not joined yet); otherwise why it is gone:
  // "rank 2 (pid 31) died", "rank 2 left the group (destroy_process_group)".
  std::string peer_gone(int r) const;
  // Whether every rank that has joined shares this rank's PID namespace (pids and
  // /proc/<pid> mean the same to all: needed to map peers' arena memory).
  bool same_pid_namespace(int r) const;

  // Allocates channel (lane, rank() -> dst)'s descriptors and first `buffers` buffers in
  // /dev/shm (idempotent); throws CommError naming the channel if it cannot.
  void reserve_channel(Lane lane, int dst, uint32_t buffers) const;
  // Allocates one more buffer of it if /dev/shm has room to spare; whether it did.
  bool try_reserve_buffer(Lane lane, int dst, uint32_t b) const;
  // This rank's stage areas (layout.h), once, before its first two-shot op.
  void reserve_stage_areas() const;

 private:
  void ring_all(Lane lane, int except) const;  // behind one fence; `except` may be -1
  static void wake_if_asleep(Bell& b);

  const ShmSegment& segment_;
  void* base_;
  Layout layout_;
  int rank_;
  int world_;
  Liveness liveness_;
};

// "all_reduce float32[1000] SUM (seq 7) on rank 0"
std::string where(const OpCall& op, int rank);
// The inode of this process's PID namespace (0 if it cannot be read), read once.
uint64_t pid_namespace_id();
// Makes the next pid_namespace_id() read it again (a forked child's may differ).
void forget_pid_namespace();

}  // namespace pycomm
