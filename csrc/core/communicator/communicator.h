// A communicator: the ranks of one process group on one host, their shared segment, and
// the collectives over it. Collectives block and must be called from one thread (the
// torch layer's worker) in the same order on every rank; send/recv go through the
// P2PEngine on their own lane and thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "core/algorithms/algorithms.h"
#include "core/base/config.h"
#include "core/base/log.h"
#include "core/communicator/rendezvous.h"
#include "core/communicator/waiter.h"
#include "core/transport/layout.h"
#include "core/transport/peer_memory.h"
#include "core/transport/shared_state.h"
#include "core/transport/shm_segment.h"
#include "core/transport/transport.h"

namespace pycomm {

// The three algorithms of a bulk collective (all_reduce, reduce_scatter, all_gather,
// broadcast, reduce): direct for small messages, else zero-copy when every rank's
// buffer is in the arena, else the streamed one (a ring, or a chain for rooted ops).
struct BulkAlgorithms {
  void (*direct)(Transport&, const OpCall&, const Args&);
  void (*streamed)(Transport&, const OpCall&, const Args&);
  void (*zero_copy)(Transport&, const OpCall&, const Args&, const std::vector<char*>&);
  const char* streamed_name;  // "ring" or "chain", for the log
  // The largest message direct takes for this family when PYCOMM_DIRECT_BYTES allows
  // more: the two-shot overtakes it sooner than the ring (kTwoShotDirectBytes).
  size_t direct_cap = ~size_t{0};
};

// Where ranks share cores the direct size (64 KiB) was measured against the ring; the
// two-shot is within 10% of direct at 8-16 KiB and ahead from 32 KiB
// (records/collectives/crossover/crossover-4r.log), so all_reduce takes direct only up to
// 4 KiB, as it does with a core per rank.
constexpr size_t kTwoShotDirectBytes = 4096;

class Communicator {
 public:
  Communicator(Rendezvous& rdv, int rank, int world, const Config& cfg,
               std::chrono::milliseconds timeout);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  uint64_t seq() const { return seq_.load(std::memory_order_relaxed); }
  const Logger& logger() const { return log_; }
  const Shared& shared() const { return *shared_; }
  // The group's settings (rank 0's, after the segment is established).
  const Config& config() const { return cfg_; }
  size_t segment_bytes() const { return segment_.size(); }
  // May be called from any thread while ops run (torch's setTimeout).
  void set_timeout(std::chrono::milliseconds t) { timeout_ms_.store(t.count()); }

  // In place on `data` (count elements). `op` is the user's op (AVG included).
  void all_reduce(void* data, size_t count, DType dtype, RedOp op);
  // `in` holds world*count elements; this rank's reduced block goes to `out`.
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, RedOp op);
  // `out` gets world*count elements, rank r's `in` at block r. `in` may be block rank().
  void all_gather(const void* in, void* out, size_t count, DType dtype);
  void broadcast(void* data, size_t count, DType dtype, int root);
  // The reduction of every rank's `in` lands in `out` at the root (in may equal out).
  void reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, int root);
  void all_to_all(const AllToAllArgs& args);
  // See CountedAllToAllArgs. Throws InvalidArgument when its counts do not fit the
  // direct area (PYCOMM_DIRECT_BYTES): check counted_fits first.
  void all_to_all_counted(const CountedAllToAllArgs& args);
  // Whether `groups` counts per rank fit the offer (every rank decides alike).
  bool counted_fits(size_t groups) const {
    return all_to_all_counted_offer_bytes(world_, groups) <= cfg_.direct_bytes;
  }
  void gather(const void* in, void* out, size_t count, DType dtype, int root);
  void scatter(const void* in, void* out, size_t count, DType dtype, int root);
  void barrier();

  // Marks this rank as leaving cleanly: a peer still waiting for it is told so at once.
  void depart(Departure how = Departure::DESTROYED);

 private:
  void log_init(const Layout& layout, std::chrono::milliseconds timeout) const;
  OpCall begin(OpKind kind, DType dtype, uint64_t count, RedOp op, int root);
  void finish(const OpCall& op);
  // Runs one op's body, logging `algo` and why it was chosen (`why()`, only when traced).
  template <class Why, class Body>
  void run_explained(OpCall& op, const char* algo, Why why, Body body);
  template <class Body>
  void run(OpCall& op, const char* algo, Body body) {
    run_explained(op, algo, [] { return std::string(); }, body);
  }
  // `offered`: this rank's buffer for the zero-copy negotiation (null: not offered).
  void run_bulk(OpCall& c, const Args& a, size_t bytes, const BulkAlgorithms& algos,
                const void* offered);
  bool use_direct(size_t bytes, size_t cap = ~size_t{0}) const;
  std::string two_shot_text() const;  // for the init line: "" when the group has none
  // From the group's settings (rank 0's), so every rank decides alike.
  bool try_zero_copy() const { return cfg_.zero_copy && cfg_.algo == Algo::AUTO; }
  // Finds out with the other ranks whether every buffer is in the arena; logs the choice
  // (zero-copy, or `fallback`: the algorithm used otherwise).
  std::vector<char*> negotiate(const OpCall& op, const void* mine, size_t bytes,
                               const char* fallback);
  std::string direct_reason(size_t bytes, size_t cap = ~size_t{0}) const;
  Args reduction_args(DType dtype, RedOp op) const;
  void check_root(int root, const char* what) const;

  int rank_, world_;
  Config cfg_;
  Logger log_;
  std::atomic<int64_t> timeout_ms_;
  ShmSegment segment_;
  std::unique_ptr<Shared> shared_;
  std::unique_ptr<Waiter> waiter_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<PeerMemory> peers_;
  std::atomic<uint64_t> seq_{0};
  bool departed_ = false;  // read by other threads (getSequenceNumberForGroup)
};

}  // namespace pycomm
