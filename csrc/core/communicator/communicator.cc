#include "core/communicator/communicator.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <thread>

#include "core/algorithms/zero_copy.h"
#include "core/base/errors.h"
#include "core/communicator/group_segment.h"
#include "core/kernels/reduce.h"

namespace pycomm {
namespace {

std::string kib(size_t bytes) {
  char buf[32];
  if (bytes >= (1u << 20))
    std::snprintf(buf, sizeof(buf), "%.1f MiB", bytes / 1048576.0);
  else
    std::snprintf(buf, sizeof(buf), "%.1f KiB", bytes / 1024.0);
  return buf;
}

std::string hostname() {
  char buf[256] = {0};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// Oversubscribed ranks (more ranks than cores) must not burn the core the peer they wait
// for needs, so they yield from the first poll (measured, records/README.md: 4 ranks on
// 2 cores, 16 B all_reduce 13.8 us with 2 us of spinning, 7.2 us with none).
uint32_t spin_us_for(const Config& cfg, int world) {
  unsigned cores = std::thread::hardware_concurrency();
  if (std::getenv("PYCOMM_SPIN_US") == nullptr && cores != 0 &&
      static_cast<unsigned>(world) > cores) {
    return 0;
  }
  return cfg.spin_us;
}

}  // namespace

Communicator::Communicator(Rendezvous& rdv, int rank, int world, const Config& cfg,
                           std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), cfg_(cfg), log_(cfg.log, rank), timeout_ms_(timeout.count()) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw InvalidArgument("pycomm: rank " + std::to_string(rank) + " is not in a group of " +
                          std::to_string(world));
  }
  GroupSegment g = establish_segment(rdv, rank_, world_, cfg_, log_);
  segment_ = std::move(g.segment);
  shared_ = std::make_unique<Shared>(segment_, g.layout, rank_, world_);
  shared_->join();
  waiter_ = std::make_unique<Waiter>(
      *shared_, COLL, WaitPolicy(spin_us_for(cfg_, world_), cfg_.yield_us, cfg_.wait_slice_us));
  transport_ = std::make_unique<Transport>(*shared_, COLL, *waiter_);
  peers_ = std::make_unique<PeerMemory>(*shared_);
  log_init(g.layout, timeout);
}

// The two-shot's part of the init line: "" when the group has none.
std::string Communicator::two_shot_text() const {
  if (cfg_.two_shot_bytes == 0) return "";
  const bool all = cfg_.two_shot_bytes >= cfg_.two_shot_piece_bytes * kMaxTwoShotPieces;
  return "two-shot for all_reduce, reduce_scatter and all_gather" +
         (all ? std::string() : " up to " + kib(cfg_.two_shot_bytes)) + " (pieces of " +
         kib(cfg_.two_shot_piece_bytes) + "), else ";
}

// The choices this rank runs with, once (INFO, subsystems INIT and SHM): after
// establish_segment, cfg_ holds the group's settings (rank 0's).
void Communicator::log_init(const Layout& layout, std::chrono::milliseconds timeout) const {
  if (log_.enabled(LogLevel::INFO, Subsys::INIT)) {
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%.1f", timeout.count() / 1000.0);
    log_.log(LogLevel::INFO, Subsys::INIT,
             "init: rank " + std::to_string(rank_) + " of " + std::to_string(world_) + " on host " +
                 hostname() + ", timeout " + secs + " s, CPU kernels " + kernel_isa());
    log_.log(LogLevel::INFO, Subsys::INIT,
             std::string("init: algorithm ") + algo_name(cfg_.algo) + ": direct up to " +
                 kib(cfg_.direct_bytes) + ", above it " + two_shot_text() +
                 "ring (chain for rooted ops" +
                 (world_ == 2 ? ", pair exchange for all_reduce" : "") + "); zero-copy " +
                 (try_zero_copy() ? "on for arena tensors" : "off") + "; waits spin " +
                 std::to_string(spin_us_for(cfg_, world_)) + " us, yield until " +
                 std::to_string(cfg_.yield_us) + " us, then sleep on a futex" +
                 (cfg_.wait_slice_us
                      ? " asking for a " + std::to_string(cfg_.wait_slice_us) + " us time slice"
                      : std::string()));
  }
  if (log_.enabled(LogLevel::INFO, Subsys::SHM)) {
    log_.log(LogLevel::INFO, Subsys::SHM,
             "shm: segment " + segment_.name() + " (" + (rank_ == 0 ? "created" : "joined") +
                 "): " + kib(layout.eager_bytes()) + " at once; a channel takes " +
                 kib(layout.first_channel_bytes()) +
                 " when first used and grows, while its "
                 "receiver is behind and /dev/shm has room, to " +
                 std::to_string(cfg_.slots) + " buffers x " + kib(cfg_.chunk_bytes) + "; " +
                 kib(layout.total_bytes()) + " if every channel did");
  }
}

// Whoever destroys a communicator says how it leaves first (depart keeps the first word).
Communicator::~Communicator() { depart(Departure::EXITED); }

void Communicator::depart(Departure how) {
  if (shared_ && !departed_) shared_->depart(how);
  departed_ = true;
}

OpCall Communicator::begin(OpKind kind, DType dtype, uint64_t count, RedOp op, int root) {
  OpCall c;
  c.desc = OpDesc{++seq_, kind, dtype, count, op, root};
  c.lane = COLL;
  const auto timeout = std::chrono::milliseconds(timeout_ms_.load());
  // The start only sets the deadline (seconds away), unless the trace log reports
  // the op's duration: then it is read finely.
  c.start = log_.enabled(LogLevel::TRACE, Subsys::COLL) ? Clock::now() : coarse_now();
  c.deadline = WaitPolicy::deadline_after(c.start, timeout);
  c.timeout_s = timeout.count() / 1000.0;
  waiter_->throw_if_aborted(c);
  RankControl* me = shared_->control(rank_);
  me->recent[c.desc.seq % 4].store(c.desc);
  me->entered_seq.store(c.desc.seq, std::memory_order_release);
  return c;
}

void Communicator::finish(const OpCall& op) {
  shared_->control(rank_)->completed_seq.store(op.desc.seq, std::memory_order_release);
  // Peers about to reuse a direct area may be waiting for this.
  shared_->ring_others(COLL);
}

std::vector<char*> Communicator::negotiate(const OpCall& op, const void* mine, size_t bytes,
                                           const char* fallback) {
  ZeroCopyPlan plan = negotiate_zero_copy(*transport_, *peers_, op, mine, bytes);
  if (log_.enabled(LogLevel::TRACE, Subsys::COLL)) {
    log_.log(LogLevel::TRACE, Subsys::COLL,
             "seq " + std::to_string(op.desc.seq) + " " + describe(op.desc) + ": " +
                 (plan.bufs.empty() ? std::string(fallback) + " (" + plan.why_not + ")"
                                    : "zero-copy (every rank's buffer is in the arena)"));
  }
  return plan.bufs;
}

// `algo` null: the body logs its own choice (it is made together with the other ranks).
// `why` is called only when the trace log is on: a reason is strings built on the heap,
// which the 1 KB op (a few µs) should not pay for when nobody reads them.
template <class Why, class Body>
void Communicator::run_explained(OpCall& op, const char* algo, Why why, Body body) {
  if (algo != nullptr && log_.enabled(LogLevel::TRACE, Subsys::COLL)) {
    std::string reason = why();
    log_.log(LogLevel::TRACE, Subsys::COLL,
             "seq " + std::to_string(op.desc.seq) + " " + describe(op.desc) + ": " + algo +
                 (reason.empty() ? "" : " (" + reason + ")"));
  }
  try {
    body();
  } catch (const CommError& e) {
    // Recorded for the job unless it came from the record (set_abort keeps the first).
    shared_->set_abort(e.what());
    throw;
  } catch (const std::exception& e) {
    shared_->set_abort("pycomm: " + where(op, rank_) + " failed: " + e.what());
    throw;
  }
  finish(op);
  if (log_.enabled(LogLevel::TRACE, Subsys::COLL)) {
    auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - op.start);
    log_.log(
        LogLevel::TRACE, Subsys::COLL,
        "seq " + std::to_string(op.desc.seq) + " done in " + std::to_string(us.count()) + " us");
  }
}

// An empty op still meets the other ranks (direct, whatever the settings), so one
// rank's 0 elements against another's 10 is a mismatch named here, not a success
// that leaves the other rank's op to pair with this rank's next one.
bool Communicator::use_direct(size_t bytes, size_t cap) const {
  return bytes == 0 || (cfg_.algo != Algo::RING && bytes <= std::min(cfg_.direct_bytes, cap));
}

std::string Communicator::direct_reason(size_t bytes, size_t cap) const {
  if (bytes == 0) return "0 elements";
  if (cfg_.algo == Algo::RING) return "PYCOMM_ALGO=ring";
  std::string limit = cap < cfg_.direct_bytes
                          ? "the two-shot's direct size " + std::to_string(cap)
                          : "PYCOMM_DIRECT_BYTES=" + std::to_string(cfg_.direct_bytes);
  const bool direct = bytes <= std::min(cfg_.direct_bytes, cap);
  return std::to_string(bytes) + (direct ? " B <= " : " B > ") + limit;
}

Args Communicator::reduction_args(DType dtype, RedOp op) const {
  check_reduction(dtype, op);
  Args a;
  a.dtype = dtype;
  a.op = kernel_op(dtype, op);
  a.scale = op == RedOp::AVG ? 1.0 / world_ : 1.0;
  return a;
}

void Communicator::check_root(int root, const char* what) const {
  if (root < 0 || root >= world_) {
    throw InvalidArgument(std::string("pycomm: ") + what + " root " + std::to_string(root) +
                          " is not a rank of this group of " + std::to_string(world_));
  }
}

// ---- collectives ---------------------------------------------------------------------------

// Direct up to the direct size; above it, zero-copy when every rank's buffer is in the
// arena (found out together), else the streamed algorithm. `bytes` is the message size.
void Communicator::run_bulk(OpCall& c, const Args& a, size_t bytes, const BulkAlgorithms& algos,
                            const void* offered) {
  const size_t cap = algos.direct_cap;
  if (use_direct(bytes, cap)) {
    return run_explained(
        c, "direct", [&] { return direct_reason(bytes, cap); },
        [&] { algos.direct(*transport_, c, a); });
  }
  if (!try_zero_copy()) {
    return run_explained(
        c, algos.streamed_name, [&] { return direct_reason(bytes, cap); },
        [&] { algos.streamed(*transport_, c, a); });
  }
  run(c, nullptr, [&] {
    auto bufs = negotiate(c, offered, bytes, algos.streamed_name);
    if (bufs.empty())
      algos.streamed(*transport_, c, a);
    else
      algos.zero_copy(*transport_, c, a, bufs);
  });
}

void Communicator::all_reduce(void* data, size_t count, DType dtype, RedOp op) {
  Args a = reduction_args(dtype, op);
  a.in = a.out = data;
  a.count = count;
  OpCall c = begin(OpKind::ALL_REDUCE, dtype, count, op, -1);
  if (world_ == 1) return run(c, "local", [] {});
  // Two ranks exchange whole buffers (all_reduce_pair.cc); more take the two-shot up to
  // its size (two_shot.cc), the ring above it.
  static constexpr BulkAlgorithms kPair{all_reduce_direct, all_reduce_pair, all_reduce_zero_copy,
                                        "pair"};
  static constexpr BulkAlgorithms kTwoShot{all_reduce_direct, all_reduce_two_shot,
                                           all_reduce_zero_copy, "two-shot", kTwoShotDirectBytes};
  static constexpr BulkAlgorithms kRing{all_reduce_direct, all_reduce_ring, all_reduce_zero_copy,
                                        "ring"};
  const size_t bytes = count * dtype_size(dtype);
  const BulkAlgorithms& algos = bytes <= cfg_.two_shot_bytes ? kTwoShot
                                : world_ == 2                ? kPair
                                                             : kRing;
  run_bulk(c, a, bytes, algos, a.in);
}

void Communicator::reduce_scatter(const void* in, void* out, size_t count, DType dtype, RedOp op) {
  Args a = reduction_args(dtype, op);
  a.in = in;
  a.out = out;
  a.count = count;
  OpCall c = begin(OpKind::REDUCE_SCATTER, dtype, count, op, -1);
  if (world_ == 1) {
    return run(c, "local", [&] { std::memmove(out, in, count * dtype_size(dtype)); });
  }
  // More than two ranks take the two-shot up to its size, as all_reduce does (at two the
  // ring is one step per chunk already), but direct keeps its size: unlike all_reduce's,
  // this two-shot was not ahead of direct below 256 KiB where ranks share cores
  // (records/collectives/two-shot/rs-ag/).
  static constexpr BulkAlgorithms kTwoShot{reduce_scatter_direct, reduce_scatter_two_shot,
                                           reduce_scatter_zero_copy, "two-shot"};
  static constexpr BulkAlgorithms kRing{reduce_scatter_direct, reduce_scatter_ring,
                                        reduce_scatter_zero_copy, "ring"};
  const size_t es = dtype_size(dtype);
  const size_t bytes = count * world_ * es;
  const bool two_shot = bytes <= cfg_.two_shot_bytes &&
                        reduce_scatter_two_shot_fits(count, es, world_, cfg_.two_shot_piece_bytes);
  run_bulk(c, a, bytes, two_shot ? kTwoShot : kRing, a.in);
}

void Communicator::all_gather(const void* in, void* out, size_t count, DType dtype) {
  Args a;
  a.in = in;
  a.out = out;
  a.count = count;
  a.dtype = dtype;
  OpCall c = begin(OpKind::ALL_GATHER, dtype, count, RedOp::NONE, -1);
  size_t bytes = count * dtype_size(dtype);
  if (world_ == 1) return run(c, "local", [&] { std::memmove(out, in, bytes); });
  // As reduce_scatter: the two-shot above the direct size, at more than two ranks.
  static constexpr BulkAlgorithms kTwoShot{all_gather_direct, all_gather_two_shot,
                                           all_gather_zero_copy, "two-shot"};
  static constexpr BulkAlgorithms kRing{all_gather_direct, all_gather_ring, all_gather_zero_copy,
                                        "ring"};
  run_bulk(c, a, bytes, bytes <= cfg_.two_shot_bytes ? kTwoShot : kRing, a.in);
}

void Communicator::broadcast(void* data, size_t count, DType dtype, int root) {
  check_root(root, "broadcast");
  Args a;
  a.in = a.out = data;
  a.count = count;
  a.dtype = dtype;
  a.root = root;
  OpCall c = begin(OpKind::BROADCAST, dtype, count, RedOp::NONE, root);
  size_t bytes = count * dtype_size(dtype);
  if (world_ == 1) return run(c, "local", [] {});
  run_bulk(c, a, bytes, {broadcast_direct, broadcast_chain, broadcast_zero_copy, "chain"}, data);
}

void Communicator::reduce(const void* in, void* out, size_t count, DType dtype, RedOp op,
                          int root) {
  check_root(root, "reduce");
  Args a = reduction_args(dtype, op);
  a.in = in;
  a.out = out;
  a.count = count;
  a.root = root;
  OpCall c = begin(OpKind::REDUCE, dtype, count, op, root);
  size_t bytes = count * dtype_size(dtype);
  if (world_ == 1) return run(c, "local", [&] { std::memmove(out, in, bytes); });
  // Peers write the result into the root's buffer, so the root offers it only when it
  // is also the input (torch's reduce is in place); otherwise all take the chain.
  const void* offered = rank_ == root && in != out ? nullptr : in;
  run_bulk(c, a, bytes, {reduce_direct, reduce_chain, reduce_zero_copy, "chain"}, offered);
}

void Communicator::all_to_all(const AllToAllArgs& args) {
  OpCall c = begin(OpKind::ALL_TO_ALL, args.dtype, 0, RedOp::NONE, -1);
  // Whether to post offers is decided on what every rank knows alike (settings, world),
  // never on its own sizes: uneven splits differ between ranks.
  if (!try_zero_copy() || all_to_all_offer_bytes(world_) > cfg_.direct_bytes)
    return run(c, "pairwise", [&] { all_to_all_pairwise(*transport_, c, args); });
  run(c, nullptr, [&] {
    int pulled = all_to_all_pull(*transport_, *peers_, c, args);
    if (log_.enabled(LogLevel::TRACE, Subsys::COLL)) {
      log_.log(LogLevel::TRACE, Subsys::COLL,
               "seq " + std::to_string(c.desc.seq) + " " + describe(c.desc) + ": pairwise, " +
                   std::to_string(pulled) + " of " + std::to_string(world_ - 1) +
                   " peers read in place (zero-copy from their arena inputs)");
    }
  });
}

void Communicator::all_to_all_counted(const CountedAllToAllArgs& args) {
  const size_t need = all_to_all_counted_offer_bytes(world_, args.groups);
  if (args.send_counts.size() != static_cast<size_t>(world_) * args.groups) {
    throw InvalidArgument("pycomm: all_to_all_counted: rank " + std::to_string(rank_) + " gave " +
                          std::to_string(args.send_counts.size()) + " counts for " +
                          std::to_string(world_) + " ranks x " + std::to_string(args.groups) +
                          " groups");
  }
  if (need > cfg_.direct_bytes) {
    throw InvalidArgument("pycomm: all_to_all_counted: " + std::to_string(world_) + " ranks x " +
                          std::to_string(args.groups) + " groups of counts take " +
                          std::to_string(need) + " bytes of the direct area, which has " +
                          std::to_string(cfg_.direct_bytes) + " (PYCOMM_DIRECT_BYTES)");
  }
  OpCall c = begin(OpKind::ALL_TO_ALL_COUNTED, args.dtype, args.row_elems, RedOp::NONE, -1);
  run(c, nullptr, [&] {
    int pulled = pycomm::all_to_all_counted(*transport_, *peers_, c, args, try_zero_copy());
    if (log_.enabled(LogLevel::TRACE, Subsys::COLL)) {
      log_.log(LogLevel::TRACE, Subsys::COLL,
               "seq " + std::to_string(c.desc.seq) + " " + describe(c.desc) +
                   ": counts in the offers, " + std::to_string(pulled) + " of " +
                   std::to_string(world_ - 1) + " peers read in place");
    }
  });
}

void Communicator::gather(const void* in, void* out, size_t count, DType dtype, int root) {
  check_root(root, "gather");
  Args a;
  a.in = in;
  a.out = out;
  a.count = count;
  a.dtype = dtype;
  a.root = root;
  OpCall c = begin(OpKind::GATHER, dtype, count, RedOp::NONE, root);
  run(c, "to root", [&] { gather_to_root(*transport_, c, a); });
}

void Communicator::scatter(const void* in, void* out, size_t count, DType dtype, int root) {
  check_root(root, "scatter");
  Args a;
  a.in = in;
  a.out = out;
  a.count = count;
  a.dtype = dtype;
  a.root = root;
  OpCall c = begin(OpKind::SCATTER, dtype, count, RedOp::NONE, root);
  run(c, "from root", [&] { scatter_from_root(*transport_, c, a); });
}

void Communicator::barrier() {
  OpCall c = begin(OpKind::BARRIER, DType::U8, 0, RedOp::NONE, -1);
  if (world_ == 1) return run(c, "local", [] {});
  run(c, "direct", [&] { barrier_direct(*transport_, c); });
}

}  // namespace pycomm
