#include "cuda/host/ring_sim.h"

#include <random>
#include <string>

#include "core/base/errors.h"

namespace pycomm {
namespace {

struct Slot {
  int64_t step = -1;      // which step of its owner it holds
  size_t msg_offset = 0;  // where it sits in the message (what the CPU receiver checks)
  std::vector<double> data;
};

struct SimRank {
  std::vector<RingStep> plan;
  std::vector<Slot> window;
  std::vector<int64_t> last_written;  // per slot: the owner's step written there last
  size_t pc = 0;                      // next step
  int64_t read_by_next = 0;           // the successor has read this rank's steps < this
  std::vector<double> out;
};

std::string where(int r, size_t step) {
  return "rank " + std::to_string(r) + " step " + std::to_string(step);
}

size_t output_elems(RingKind kind, size_t count, int n) {
  return kind == RingKind::ALL_GATHER ? count * n : count;
}

bool ready(const std::vector<SimRank>& ranks, int r, int n, int slots) {
  const SimRank& me = ranks[r];
  const RingStep& s = me.plan[me.pc];
  const SimRank& prev = ranks[(r + n - 1) % n];
  if (s.reads_prev && static_cast<int64_t>(prev.pc) <= s.prev_step) return false;
  if (s.writes_window) {
    int64_t held = me.last_written[me.pc % slots];
    if (held >= 0 && me.read_by_next <= held) return false;
  }
  return true;
}

void run_step(std::vector<SimRank>& ranks, const std::vector<std::vector<double>>& inputs, int r,
              int n, int slots) {
  SimRank& me = ranks[r];
  const RingStep& s = me.plan[me.pc];
  std::vector<double> value(s.count, 0.0);
  if (s.reads_local) {
    for (size_t i = 0; i < s.count; ++i) value[i] += inputs[r].at(s.in_offset + i);
  }
  if (s.reads_prev) {
    int p = (r + n - 1) % n;
    SimRank& prev = ranks[p];
    const Slot& slot = prev.window[s.prev_step % slots];
    if (slot.step != s.prev_step || slot.data.size() != s.count ||
        slot.msg_offset != s.msg_offset) {
      throw CommError("pycomm ring sim: " + where(r, me.pc) + " read rank " + std::to_string(p) +
                      "'s slot expecting its step " + std::to_string(s.prev_step) + " with " +
                      std::to_string(s.count) + " elements at " + std::to_string(s.msg_offset) +
                      ", found step " + std::to_string(slot.step) + " with " +
                      std::to_string(slot.data.size()) + " at " + std::to_string(slot.msg_offset));
    }
    for (size_t i = 0; i < s.count; ++i) value[i] += slot.data[i];
    prev.read_by_next = s.prev_step + 1;
  }
  if (s.writes_window) {
    Slot& slot = me.window[me.pc % slots];
    slot.step = static_cast<int64_t>(me.pc);
    slot.msg_offset = s.msg_offset;
    slot.data = value;
    me.last_written[me.pc % slots] = slot.step;
  }
  if (s.writes_out) {
    for (size_t i = 0; i < s.count; ++i) me.out.at(s.out_offset + i) = value[i];
  }
  ++me.pc;
}

}  // namespace

RingSimResult simulate_ring(RingKind kind, const std::vector<std::vector<double>>& inputs,
                            size_t count, int root, size_t chunk_elems, int slots, uint64_t seed) {
  const int n = static_cast<int>(inputs.size());
  std::vector<SimRank> ranks(n);
  for (int r = 0; r < n; ++r) {
    ranks[r].plan = plan_ring(kind, count, r, n, root, chunk_elems);
    ranks[r].window.resize(slots);
    ranks[r].last_written.assign(slots, -1);
    ranks[r].out.assign(output_elems(kind, count, n), 0.0);
    if (kind == RingKind::BROADCAST && r == root) ranks[r].out = inputs[r];
    if (ranks[r].plan.size() != ranks[0].plan.size()) {
      throw CommError("pycomm ring sim: rank " + std::to_string(r) + " plans " +
                      std::to_string(ranks[r].plan.size()) + " steps, rank 0 plans " +
                      std::to_string(ranks[0].plan.size()));
    }
  }
  std::mt19937_64 rng(seed);
  RingSimResult result;
  result.steps = ranks[0].plan.size();
  std::vector<size_t> blocked(n, 0);
  for (;;) {
    bool all_done = true, progressed = false;
    const size_t start = rng() % n;
    for (int k = 0; k < n; ++k) {
      int r = static_cast<int>((start + k) % n);
      if (ranks[r].pc == ranks[r].plan.size()) continue;
      all_done = false;
      if (!ready(ranks, r, n, slots)) {
        result.max_waits = std::max(result.max_waits, ++blocked[r]);
        continue;
      }
      blocked[r] = 0;
      run_step(ranks, inputs, r, n, slots);
      progressed = true;
      if (rng() % 2) {  // vary who runs ahead
        all_done = false;
        break;
      }
    }
    if (all_done) break;
    if (!progressed) {
      std::string msg = "pycomm ring sim: deadlock;";
      for (int r = 0; r < n; ++r) msg += " " + where(r, ranks[r].pc) + ";";
      throw CommError(msg);
    }
  }
  for (int r = 0; r < n; ++r) result.outputs.push_back(std::move(ranks[r].out));
  return result;
}

}  // namespace pycomm
