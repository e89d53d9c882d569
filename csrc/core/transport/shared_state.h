// One rank's view of the mapped segment: where things are, doorbells, the abort record,
// and whether a peer process is still alive.
#pragma once

#include <chrono>
#include <string>

#include "core/runtime/types.h"
#include "core/transport/layout.h"

namespace pycomm {

using Clock = std::chrono::steady_clock;

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
  Shared(void* base, const Layout& layout, int rank, int world)
      : base_(base), layout_(layout), rank_(rank), world_(world) {}

  int rank() const { return rank_; }
  int world() const { return world_; }
  void* base() const { return base_; }
  const Layout& layout() const { return layout_; }
  SegmentHeader* header() const { return layout_.header(base_); }
  RankControl* control(int r) const { return layout_.control(base_, r); }
  Bell& bell(int r, Lane lane) const { return control(r)->bells[lane]; }

  // Tells rank r that something it may be waiting for on `lane` has changed.
  void ring(int r, Lane lane) const;
  void ring_everyone(Lane lane) const;

  // The first failure anywhere in the job is recorded once; every rank then raises it.
  bool aborted() const;
  std::string abort_message() const;
  // Records `msg` unless another failure was recorded first; wakes every rank.
  void set_abort(const std::string& msg) const;

  // False once rank r's process has exited (or is a zombie); true if unknown.
  bool peer_alive(int r) const;

 private:
  void* base_;
  Layout layout_;
  int rank_;
  int world_;
};

// "all_reduce float32[1000] SUM (seq 7) on rank 0"
std::string where(const OpCall& op, int rank);

}  // namespace pycomm
