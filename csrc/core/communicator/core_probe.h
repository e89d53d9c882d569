// A 0.1 s reading of how fast two cores hand each other data: benchmark tables state one
// before and after, because on small shared hosts the cache state flips every few seconds
// (round trip ~60 ns and ~12 GB/s in the fast state, ~250-370 ns and ~2 GB/s in the slow).
#pragma once

namespace pycomm {

struct CoreProbe {
  double round_trip_ns;  // one cache line, cpu_a -> cpu_b -> cpu_a; best batch
  double handoff_gbs;    // 256 KiB chunks written on cpu_a, read on cpu_b; best batch
  double exchange_gbs;   // per direction, each CPU writing to and reading from the other
                         // at once (a symmetric collective's pattern); best batch
  int cpu_a, cpu_b;      // the CPUs measured (resolved when -1 was asked for)
};

// Measures cpu_a <-> cpu_b with two threads pinned there (the caller's thread is not
// pinned): first a ping-pong of one cache line, then a writer -> reader handoff of 256 KiB
// chunks through 4 slots, the pattern of a shared-memory ring, then the same both ways at
// once (each CPU writes to and reads from the other, as every rank of an all_reduce does).
// Each phase runs batches for a third of budget_s (3 at least) and reports its best
// batch, so a preemption does not dominate. Bounded: a wait past the phase's time (or
// longer than 1 ms) yields instead of spinning, and the probe ends within budget_s + 1 s,
// with its numbers or an error.
//
// cpu_a / cpu_b = -1 pick the first / next CPU of the calling thread's affinity set.
// Throws std::invalid_argument if both name the same CPU or a CPU cannot be pinned to (it
// is outside that set; the message names it and the set), or budget_s is not in (0, 60];
// std::runtime_error if no batch completes (other work keeps the CPUs busy).
CoreProbe probe_cores(int cpu_a, int cpu_b, double budget_s = 0.1);

}  // namespace pycomm
