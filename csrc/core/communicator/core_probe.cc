// Core-to-core probe: two pinned threads, a cache-line ping-pong, a 4-slot handoff one way,
// then both ways at once.
#include "core/communicator/core_probe.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace pycomm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kRoundsPerBatch = 512;  // 30 us fast, 0.2 ms slow: fits between preemptions
constexpr size_t kChunk = 256 << 10;
constexpr uint64_t kSlots = 4;
constexpr uint64_t kChunksPerBatch = 8;   // 2 MiB: 0.2 ms fast, 1 ms slow
constexpr int kMinSamples = 3;            // batches per phase, even past its time
constexpr int64_t kPatienceNs = 1000000;  // a wait this long yields: the partner is off-CPU
constexpr double kGraceS = 1.0;           // past budget_s, for kMinSamples to finish

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// "0-3,6": a CPU set as Linux writes CPU lists.
std::string cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(cpus[i]);
    if (j > i) out += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    throw std::runtime_error(std::string("probe_cores: sched_getaffinity: ") + strerror(errno));
  }
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

// -1 becomes the first allowed CPU that is not `other`; anything else must be allowed.
int resolve_cpu(int cpu, int other, const std::vector<int>& allowed, const char* which) {
  auto named = [&](int c) { return std::find(allowed.begin(), allowed.end(), c) != allowed.end(); };
  if (cpu == -1) {
    for (int c : allowed) {
      if (c != other) return c;
    }
    throw std::invalid_argument("probe_cores: needs two CPUs, but this thread may run only on " +
                                cpu_list(allowed));
  }
  if (!named(cpu)) {
    throw std::invalid_argument(
        std::string("probe_cores: ") + which + " is cpu " + std::to_string(cpu) +
        ", which this thread may not run on (allowed: " + cpu_list(allowed) + ")");
  }
  return cpu;
}

// One direction's ring of kSlots chunks: its writer publishes `written`, its reader frees
// slots with `read`; each counter has a cache line of its own.
struct Ring {
  alignas(64) std::atomic<uint64_t> written{0};
  alignas(64) std::atomic<uint64_t> read{0};
  char* slots = nullptr;

  char* slot(uint64_t chunk) const { return slots + (chunk % kSlots) * kChunk; }
};

// What the two threads share; each counter has a cache line of its own.
struct Shared {
  alignas(64) std::atomic<uint64_t> ball{0};    // ping-pong: odd from a, even from b
  alignas(64) std::atomic<int> phases_over{0};  // 1: ping-pong, 2: handoff, 3: exchange over
  std::atomic<int64_t> soft_ns{0};              // this phase's end; past it, waits yield
  std::atomic<int> pinned{0};
  std::atomic<bool> pin_failed{false};
  std::atomic<bool> gave_up{false};  // the hard deadline passed
  int64_t hard_ns = 0;
  double phase_s = 0;
  Ring to_b, to_a;                    // a -> b (handoff and exchange), b -> a (exchange)
  std::atomic<uint64_t> checksum{0};  // the readers' sums, so that their reads stay

  void begin_phase() { soft_ns.store(now_ns() + static_cast<int64_t>(phase_s * 1e9)); }
  bool past_phase() const { return now_ns() > soft_ns.load(); }
  // Thread a ends phase n; the next one's deadline is set first so that thread b, moving
  // on, never sees the old one and yields for nothing.
  void end_phase(int n) {
    begin_phase();
    phases_over.store(n, std::memory_order_release);
  }
};

// Polls ready() until it holds; false if the hard deadline passes, if `phase` (when > 0)
// is over, or, with may_abandon, once this phase's time is up. The clock is read every
// 1024 polls only, so a wait that ends in nanoseconds never reads it. A waiter that is
// past the phase's time, or has waited 1 ms, yields between polls: on oversubscribed
// cores its partner may not be running, and the CPU we spin on may be what it lacks.
template <class Ready>
bool wait_for(Shared& s, Ready ready, bool may_abandon, int phase) {
  bool yielding = false;
  int64_t since = 0;
  for (uint32_t polls = 1;; ++polls) {
    if (ready()) return true;
    if (!yielding && polls % 1024 != 0) continue;
    int64_t now = now_ns();
    if (now > s.hard_ns || s.gave_up.load(std::memory_order_relaxed)) {
      s.gave_up.store(true);
      return false;
    }
    if (phase > 0 && s.phases_over.load(std::memory_order_acquire) >= phase) return false;
    bool late = now > s.soft_ns.load(std::memory_order_relaxed);
    if (late && may_abandon) return false;
    if (since == 0) since = now;
    yielding = late || now - since > kPatienceNs;
    if (yielding) sched_yield();
  }
}

// Pins the calling thread and waits for its partner to be pinned too; "" or why not.
std::string pin_and_meet(Shared& s, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) {
    s.pin_failed.store(true);
    return "probe_cores: cannot pin a thread to cpu " + std::to_string(cpu) + ": " + strerror(rc);
  }
  s.pinned.fetch_add(1);
  while (s.pinned.load() < 2 && !s.pin_failed.load() && now_ns() < s.hard_ns) sched_yield();
  return s.pinned.load() == 2 ? "" : "probe_cores: the partner thread was not pinned";
}

// Thread a, phase 1: batches of round trips until the phase's time is up and kMinSamples
// batches are done; the best batch's time per round trip (infinity if none finished).
double ping(Shared& s) {
  double best = std::numeric_limits<double>::infinity();
  uint64_t ball = 0;
  for (int done = 0; done < kMinSamples || !s.past_phase(); ++done) {
    auto t0 = Clock::now();
    bool whole = true;
    for (int r = 0; r < kRoundsPerBatch && whole; ++r) {
      s.ball.store(++ball, std::memory_order_release);
      uint64_t back = ++ball;
      auto returned = [&] { return s.ball.load(std::memory_order_acquire) == back; };
      whole = wait_for(s, returned, done >= kMinSamples, 0);
    }
    if (!whole) break;  // a batch cut short by a deadline does not count
    double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
    best = std::min(best, ns / kRoundsPerBatch);
  }
  return best;
}

// Thread b, phase 1: returns each ball until thread a ends the phase.
void pong(Shared& s) {
  for (uint64_t ball = 1;; ball += 2) {
    auto thrown = [&] { return s.ball.load(std::memory_order_acquire) == ball; };
    if (!wait_for(s, thrown, false, 1)) return;
    s.ball.store(ball + 1, std::memory_order_release);
  }
}

// Times batches of kChunksPerBatch chunks moved. Once the ring is full, the writer starts
// a chunk whenever the reader frees a slot, so the time between chunk i and chunk
// i + kChunksPerBatch is the ring's period for that many chunks, with no fill or drain in
// it. Keeps the best batch's GB/s.
struct BatchTimer {
  const Shared& s;
  double best_gbs = 0;
  int done = 0;
  Clock::time_point mark;

  // Called as chunk number `chunk` starts; true once kMinSamples are done and the phase's
  // time is up.
  bool over_at(uint64_t chunk) {
    if (chunk < kSlots || (chunk - kSlots) % kChunksPerBatch != 0) return false;
    auto now = Clock::now();
    if (chunk > kSlots) {
      double sec = std::chrono::duration<double>(now - mark).count();
      best_gbs = std::max(best_gbs, kChunksPerBatch * kChunk / sec / 1e9);
      if (++done >= kMinSamples && s.past_phase()) return true;
    }
    mark = now;
    return false;
  }
};

void write_chunk(Ring& ring, uint64_t chunk) {
  std::memset(ring.slot(chunk), static_cast<int>(chunk & 0xff), kChunk);
  ring.written.store(chunk + 1, std::memory_order_release);
}

uint64_t read_chunk(Ring& ring, uint64_t chunk) {
  const auto* words = reinterpret_cast<const uint64_t*>(ring.slot(chunk));
  uint64_t sum = 0;
  for (size_t k = 0; k < kChunk / sizeof(uint64_t); ++k) sum += words[k];
  ring.read.store(chunk + 1, std::memory_order_release);
  return sum;
}

// Thread a, phase 2: streams 256 KiB chunks through the 4 slots to thread b, until the
// phase's time is up and kMinSamples batches are done; the best one's GB/s (0 if none).
double write_chunks(Shared& s) {
  Ring& ring = s.to_b;
  BatchTimer timer{s};
  for (uint64_t chunk = 0;; ++chunk) {
    // Wait until the reader is done with this slot's previous chunk.
    auto slot_free = [&] { return ring.read.load(std::memory_order_acquire) + kSlots > chunk; };
    if (!wait_for(s, slot_free, timer.done >= kMinSamples, 0)) break;
    if (timer.over_at(chunk)) break;
    write_chunk(ring, chunk);
  }
  return timer.best_gbs;
}

// Thread b, phase 2: reads (sums) each chunk as it is published, then frees its slot.
void read_chunks(Shared& s) {
  uint64_t sum = 0;
  for (uint64_t chunk = 0;; ++chunk) {
    auto published = [&] { return s.to_b.written.load(std::memory_order_acquire) > chunk; };
    if (!wait_for(s, published, false, 2)) break;
    sum += read_chunk(s.to_b, chunk);
  }
  s.checksum += sum;
}

// Phase 3, both threads: each writes chunks to the other and reads the other's at once,
// as every rank of a symmetric collective sends and receives. On some hosts this moves
// half of the one-way rate in each direction (docs/benchmarks.md: why a staged
// all_reduce costs what it does; too variable to bound the benchmark's limit).
// A thread reads a chunk once it has written as many as it has read (or when it cannot
// write), so the two directions move in step: left to read whenever it can, one direction
// runs ahead at the one-way rate while the other stalls, and a batch timed as the other
// catches up reads as both at once. Thread a times the chunks that have moved both ways
// (the fewer of those it wrote and read), GB/s per direction, best batch, and ends the
// phase; thread b runs until it is over.
double exchange_chunks(Shared& s, bool timed) {
  Ring& out = timed ? s.to_b : s.to_a;
  Ring& in = timed ? s.to_a : s.to_b;
  BatchTimer timer{s};
  uint64_t wrote = 0, got = 0, both_ways = 0, sum = 0;
  auto can_read = [&] { return in.written.load(std::memory_order_acquire) > got; };
  auto can_write = [&] { return out.read.load(std::memory_order_acquire) + kSlots > wrote; };
  auto either = [&] { return can_read() || can_write(); };
  for (;;) {
    if (!wait_for(s, either, timed && timer.done >= kMinSamples, timed ? 0 : 3)) break;
    if (can_read() && (got < wrote || !can_write())) {
      sum += read_chunk(in, got++);
    } else {
      write_chunk(out, wrote++);
    }
    if (timed && std::min(wrote, got) > both_ways) {
      both_ways = std::min(wrote, got);
      if (timer.over_at(both_ways)) break;
    }
  }
  s.checksum += sum;
  return timer.best_gbs;
}

}  // namespace

CoreProbe probe_cores(int cpu_a, int cpu_b, double budget_s) {
  if (!(budget_s > 0 && budget_s <= 60)) {
    throw std::invalid_argument("probe_cores: budget_s is " + std::to_string(budget_s) +
                                "; it must be in (0, 60]");
  }
  if (cpu_a < -1 || cpu_b < -1) {
    throw std::invalid_argument("probe_cores: cpu " + std::to_string(std::min(cpu_a, cpu_b)) +
                                " is not a CPU (-1 picks one from the affinity set)");
  }
  std::vector<int> allowed = allowed_cpus();
  if (cpu_a == cpu_b && cpu_a != -1) {
    throw std::invalid_argument(
        "probe_cores: cpu_a and cpu_b are both cpu " + std::to_string(cpu_a) +
        "; it takes two different CPUs (allowed: " + cpu_list(allowed) + ")");
  }
  cpu_a = resolve_cpu(cpu_a, cpu_b, allowed, "cpu_a");
  cpu_b = resolve_cpu(cpu_b, cpu_a, allowed, "cpu_b");

  Shared s;
  s.phase_s = budget_s / 3;
  s.hard_ns = now_ns() + static_cast<int64_t>((budget_s + kGraceS) * 1e9);
  std::unique_ptr<char, decltype(&std::free)> slots(
      static_cast<char*>(std::aligned_alloc(4096, 2 * kSlots * kChunk)), &std::free);
  if (!slots) throw std::runtime_error("probe_cores: cannot allocate the 2 MiB of slots");
  std::memset(slots.get(), 1, 2 * kSlots * kChunk);  // fault the pages in before timing
  s.to_b.slots = slots.get();
  s.to_a.slots = slots.get() + kSlots * kChunk;

  CoreProbe out{0, 0, 0, cpu_a, cpu_b};
  std::string error_a, error_b;
  std::thread a([&] {
    error_a = pin_and_meet(s, cpu_a);
    if (!error_a.empty()) return;
    s.begin_phase();
    out.round_trip_ns = ping(s);
    s.end_phase(1);
    if (std::isfinite(out.round_trip_ns)) out.handoff_gbs = write_chunks(s);
    s.end_phase(2);
    if (out.handoff_gbs > 0) out.exchange_gbs = exchange_chunks(s, true);
    s.end_phase(3);
  });
  std::thread b([&] {
    error_b = pin_and_meet(s, cpu_b);
    if (!error_b.empty()) return;
    pong(s);
    read_chunks(s);
    exchange_chunks(s, false);
  });
  a.join();
  b.join();

  // A thread that could not pin says why; its partner only says that it was left alone.
  for (const std::string* e : {&error_a, &error_b}) {
    if (e->find("cannot pin") != std::string::npos) {
      throw std::invalid_argument(*e + " (allowed: " + cpu_list(allowed) + ")");
    }
  }
  if (!error_a.empty() || !error_b.empty()) {
    throw std::runtime_error(error_a.empty() ? error_b : error_a);
  }
  if (!std::isfinite(out.round_trip_ns) || out.handoff_gbs <= 0 || out.exchange_gbs <= 0) {
    const char* phase = !std::isfinite(out.round_trip_ns) ? "ping-pong"
                        : out.handoff_gbs <= 0            ? "handoff"
                                                          : "exchange";
    throw std::runtime_error(std::string("probe_cores: no ") + phase + " batch between cpu " +
                             std::to_string(cpu_a) + " and cpu " + std::to_string(cpu_b) +
                             " finished within " + std::to_string(budget_s + kGraceS) +
                             " s; other work keeps those CPUs busy");
  }
  return out;
}

}  // namespace pycomm
