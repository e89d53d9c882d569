#include "core/communicator/group_segment.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "core/base/errors.h"
#include "core/transport/shared_state.h"

namespace pycomm {
namespace {

const char* kSegmentKey = "segment";
const char* kStartedKey = "started";
std::string opened_key(int r) { return "opened/" + std::to_string(r); }
// Shared with pycomm/_startup.py, which posts them before the group is built.
const char* kFailedKey = "pycomm-init/failed";
std::string pid_key(int r) { return "pycomm-init/pid/" + std::to_string(r); }

uint64_t own_pid_namespace() {
  struct stat st{};
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

bool is_zombie(int pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char line[512] = {0};
  size_t n = std::fread(line, 1, sizeof(line) - 1, f);
  std::fclose(f);
  const char* close_paren = std::strrchr(line, ')');  // "pid (comm) S ..."
  return n > 0 && close_paren != nullptr && close_paren[1] == ' ' && close_paren[2] == 'Z';
}

// Rank `peer`'s death, if it posted its pid from this PID namespace and that process
// is gone ("" otherwise: alive, elsewhere, or not announced).
std::string died(Rendezvous& rdv, int peer) {
  auto v = rdv.try_get(pid_key(peer));
  if (!v) return "";
  long long pid = 0;
  unsigned long long ns = 0;
  if (std::sscanf(v->c_str(), "%lld %llu", &pid, &ns) != 2 || pid <= 0) return "";
  if (ns == 0 || ns != own_pid_namespace()) return "";
  bool gone = kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
  if (!gone) gone = is_zombie(static_cast<int>(pid));  // dead, its parent not told yet
  if (!gone) return "";
  return "rank " + std::to_string(peer) + " (pid " + std::to_string(pid) +
         ") died before the group started";
}

// `key`'s value once set. Meanwhile watches for a failure any rank posted and for the
// death of `peer` (the rank that sets the key), so nobody waits out the store's timeout
// for a rank that is gone or gave up; `what` names the wait in the timeout's message.
std::string wait_for(Rendezvous& rdv, const std::string& key, int rank, int peer,
                     const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  auto pause = std::chrono::microseconds(200);
  for (int polls = 0;; ++polls) {
    if (auto v = rdv.try_get(key)) return *v;
    if (polls % 8 == 7) {  // a few ms apart at first, then every ~50 ms
      std::string why;
      if (auto failed = rdv.try_get(kFailedKey)) why = *failed;
      if (why.empty()) why = died(rdv, peer);
      if (!why.empty()) {
        throw CommError("pycomm: rank " + std::to_string(rank) +
                        ": the group cannot start: " + why);
      }
      if (std::chrono::steady_clock::now() - start > rdv.timeout()) {
        throw CommError("pycomm: rank " + std::to_string(rank) + ": the group cannot start: " +
                        what + " did not happen within the store's timeout (" +
                        std::to_string(rdv.timeout().count() / 1000) + " s)");
      }
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(50));
  }
}

std::string mib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", bytes / 1048576.0);
  return buf;
}

// The direct algorithm takes one step where the ring takes 2(n-1), but every rank reads
// every rank's whole message. Measured here (python -m bench.algo_crossover, both in one
// job; records/README.md): with a core per rank (2 ranks) the ring, zero-copy negotiation
// included, is as fast at 4 KiB and faster from 8 KiB (16 KiB: 2.8 us against 3.4), so
// direct stops at 4 KiB; oversubscribed, every ring step waits for a descheduled peer
// and direct wins up to 64 KiB.
size_t direct_bytes_for(const Config& cfg, int world) {
  if (std::getenv("PYCOMM_DIRECT_BYTES") != nullptr) return cfg.direct_bytes;
  unsigned cores = std::thread::hardware_concurrency();
  bool oversubscribed = cores != 0 && static_cast<unsigned>(world) > cores;
  return oversubscribed ? 64 << 10 : 4 << 10;
}

// The two-shot all_reduce (two_shot.cc) takes two steps per piece where the ring takes
// 2(n-1) per chunk, for about the ring's memory traffic. Measured here (4 ranks on 2
// CPUs, records/collectives/two-shot/all-reduce/): the ring took a median 1.07-1.39x its
// time from 64 KiB to 64 MiB, so it takes every size. Two ranks have the pair exchange,
// faster still (the two-shot took 1.03-1.16x its time: two-shot/pair-2r/).
// reduce_scatter and all_gather take it too, one step per piece where the ring takes
// n-1: the ring took a median 0.93-1.26x and 1.13-1.24x their time from 64 KiB
// (two-shot/rs-ag/). PYCOMM_ALGO=ring or direct forces that algorithm.
size_t two_shot_bytes_for(const Config& cfg, int world) {
  if (world < 2 || cfg.algo != Algo::AUTO) return 0;  // a forced algorithm is what runs
  if (cfg.two_shot_bytes != kTwoShotAuto) return cfg.two_shot_bytes;
  return world > 2 ? cfg.two_shot_piece_bytes * kMaxTwoShotPieces : 0;
}

bool two_shot_in_range(const GroupSettings& s) {
  return s.two_shot_piece_bytes >= 64 && s.two_shot_piece_bytes % 64 == 0 &&
         s.two_shot_piece_bytes <= (1ull << 30) &&
         s.two_shot_bytes <= s.two_shot_piece_bytes * kMaxTwoShotPieces;
}

// "ok <total bytes> <name>" or "error <why>", as rank 0 posts it.
struct SegmentRecord {
  bool ok = false;
  size_t total = 0;
  std::string name_or_error;
};

SegmentRecord parse_record(const std::string& v, int rank) {
  SegmentRecord rec;
  if (v.rfind("error ", 0) == 0) {
    rec.name_or_error = v.substr(6);
    return rec;
  }
  size_t space = v.find(' ', 3);
  if (v.rfind("ok ", 0) == 0 && space != std::string::npos && space > 3) {
    char* end = nullptr;
    std::string digits = v.substr(3, space - 3);
    unsigned long long total = std::strtoull(digits.c_str(), &end, 10);
    if (end != nullptr && *end == '\0' &&
        digits.find_first_not_of("0123456789") == std::string::npos) {
      rec.ok = true;
      rec.total = total;
      rec.name_or_error = v.substr(space + 1);
      return rec;
    }
  }
  throw CommError("pycomm: rank " + std::to_string(rank) +
                  " cannot join: the store's segment record '" + v.substr(0, 200) +
                  "' is not one pycomm writes");
}

std::string setting_mismatches(const GroupSettings& mine, const GroupSettings& group) {
  std::string out;
  auto note = [&](const char* var, const std::string& here, const std::string& there) {
    if (here != there) {
      out += std::string(out.empty() ? "" : "; ") + var + " is " + here + " on this rank but " +
             there + " on rank 0";
    }
  };
  auto algo = [](uint32_t a) { return std::string(algo_name(static_cast<Algo>(a))); };
  note("PYCOMM_ALGO", algo(mine.algo), algo(group.algo));
  note("PYCOMM_ZERO_COPY", std::to_string(mine.zero_copy), std::to_string(group.zero_copy));
  note("PYCOMM_CHUNK_BYTES", std::to_string(mine.slot_bytes), std::to_string(group.slot_bytes));
  note("PYCOMM_SLOTS", std::to_string(mine.slots), std::to_string(group.slots));
  note("PYCOMM_DIRECT_BYTES", std::to_string(mine.direct_bytes),
       std::to_string(group.direct_bytes));
  note("PYCOMM_STRIPES", std::to_string(mine.stripes), std::to_string(group.stripes));
  note("PYCOMM_STRIPE_BYTES", std::to_string(mine.stripe_bytes),
       std::to_string(group.stripe_bytes));
  note("PYCOMM_TWO_SHOT_BYTES", std::to_string(mine.two_shot_bytes),
       std::to_string(group.two_shot_bytes));
  note("PYCOMM_TWO_SHOT_PIECE_BYTES", std::to_string(mine.two_shot_piece_bytes),
       std::to_string(group.two_shot_piece_bytes));
  return out;
}

// The header of a segment another rank created, checked against what was announced
// before any offset derived from it is used.
Layout checked_layout(const ShmSegment& seg, size_t total, int world, int rank) {
  const auto* h = static_cast<const SegmentHeader*>(seg.data());
  const GroupSettings& s = h->settings;
  std::string why;
  if (h->magic != kSegmentMagic)
    why = "its header is not this pycomm's (segment format v6; another version on rank 0?)";
  else if (h->world != world)
    why = "it is for " + std::to_string(h->world) + " ranks, not " + std::to_string(world);
  else if (h->total_bytes != total)
    why = "its header says " + std::to_string(h->total_bytes) + " bytes, the store " +
          std::to_string(total);
  else if (s.slots < 2 || s.slots > 64 || s.slot_bytes < 64 || s.slot_bytes % 64 != 0 ||
           s.slot_bytes > (1ull << 40) || s.direct_bytes > (1ull << 30) || s.zero_copy > 1 ||
           s.algo > static_cast<uint32_t>(Algo::DIRECT) || s.stripes < 1 ||
           s.stripes > kMaxStripes || s.stripe_bytes < 64 * kMaxStripes || !two_shot_in_range(s))
    why = "its settings are out of range";
  else if (Layout(world, s).total_bytes() != total)
    why = "its settings describe a layout of another size";
  if (!why.empty()) {
    throw CommError("pycomm: rank " + std::to_string(rank) + " refuses segment " + seg.name() +
                    ": " + why);
  }
  return Layout(world, s);
}

void apply(const GroupSettings& s, Config& cfg) {
  cfg.slots = s.slots;
  cfg.chunk_bytes = s.slot_bytes;
  cfg.direct_bytes = s.direct_bytes;
  cfg.algo = static_cast<Algo>(s.algo);
  cfg.zero_copy = s.zero_copy != 0;
  cfg.stripes = s.stripes;
  cfg.stripe_bytes = s.stripe_bytes;
  cfg.two_shot_bytes = s.two_shot_bytes;
  cfg.two_shot_piece_bytes = s.two_shot_piece_bytes;
}

GroupSegment create(Rendezvous& rdv, int world, Config& cfg) {
  GroupSettings s = group_settings(cfg, world);
  apply(s, cfg);
  Layout layout(world, s);
  std::string what = "a " + std::to_string(world) + "-rank group (" + mib(layout.eager_bytes()) +
                     " at once, channels of " + std::to_string(s.slots) + " slots x " +
                     std::to_string(s.slot_bytes) + " bytes as they are used)";
  GroupSegment g{ShmSegment(), layout};
  try {
    g.segment = ShmSegment::create(layout.total_bytes(), layout.eager_bytes(), what);
  } catch (const std::exception& e) {
    rdv.set(kSegmentKey, std::string("error ") + e.what());
    throw;
  }
  auto* h = layout.header(g.segment.data());
  h->magic = kSegmentMagic;
  h->world = world;
  h->total_bytes = layout.total_bytes();
  h->settings = s;
  rdv.set(kSegmentKey, "ok " + std::to_string(layout.total_bytes()) + " " + g.segment.name());
  std::string failed;
  for (int r = 1; r < world && failed.empty(); ++r) {
    try {
      std::string v =
          wait_for(rdv, opened_key(r), 0, r, "rank " + std::to_string(r) + " mapping the segment");
      if (v.rfind("error ", 0) == 0)
        failed = "rank " + std::to_string(r) + " could not join: " + v.substr(6);
    } catch (const CommError& e) {
      failed = e.what();
    }
  }
  // Every rank has it mapped (or gave up): the name can go, and so can the keys.
  g.segment.unlink();
  rdv.remove(kSegmentKey);
  for (int r = 1; r < world; ++r) rdv.remove(opened_key(r));
  if (!failed.empty()) {
    // The ranks that did join fail too, at once (they wait for kStartedKey).
    std::string msg = failed.rfind("pycomm: ", 0) == 0
                          ? failed
                          : "pycomm: rank 0: the group cannot start: " + failed;
    Shared(g.segment, layout, 0, world).set_abort(msg);
    rdv.set(kStartedKey, "error " + msg);
    throw CommError(msg);
  }
  rdv.set(kStartedKey, "ok");
  return g;
}

GroupSegment join(Rendezvous& rdv, int rank, int world, Config& cfg, const Logger& log) {
  GroupSettings mine = group_settings(cfg, world);
  SegmentRecord rec =
      parse_record(wait_for(rdv, kSegmentKey, rank, 0, "rank 0 creating the segment"), rank);
  if (!rec.ok) {
    throw CommError("pycomm: rank " + std::to_string(rank) +
                    " cannot join: rank 0 failed to set up shared memory: " + rec.name_or_error);
  }
  try {
    ShmSegment seg = ShmSegment::open(rec.name_or_error, rec.total);
    Layout layout = checked_layout(seg, rec.total, world, rank);
    const GroupSettings group = static_cast<const SegmentHeader*>(seg.data())->settings;
    std::string differ = setting_mismatches(mine, group);
    if (!differ.empty()) {
      log.log(LogLevel::WARN, Subsys::INIT,
              differ + ": rank 0's settings apply to the whole group");
    }
    apply(group, cfg);
    rdv.set(opened_key(rank), "ok");
    std::string started = wait_for(rdv, kStartedKey, rank, 0, "rank 0 hearing from every rank");
    if (started != "ok") throw CommError(started.substr(started.find(' ') + 1));
    return GroupSegment{std::move(seg), layout};
  } catch (const std::exception& e) {
    rdv.set(opened_key(rank), std::string("error ") + e.what());
    throw;
  }
}

}  // namespace

void report_init_failure(Rendezvous& rdv, int rank, const std::string& why) {
  try {
    if (rdv.try_get(kFailedKey)) return;  // the first failure stands
    rdv.set(kFailedKey, "rank " + std::to_string(rank) + " failed at init: " + why);
  } catch (...) {  // the store is gone too: the others time out, as before
  }
}

GroupSettings group_settings(const Config& cfg, int world) {
  GroupSettings s{};
  s.slots = cfg.slots;
  s.algo = static_cast<uint32_t>(cfg.algo);
  s.slot_bytes = cfg.chunk_bytes;
  s.direct_bytes = direct_bytes_for(cfg, world);
  s.zero_copy = cfg.zero_copy ? 1 : 0;
  s.stripes = cfg.stripes;
  s.stripe_bytes = cfg.stripe_bytes;
  s.two_shot_bytes = two_shot_bytes_for(cfg, world);
  s.two_shot_piece_bytes = cfg.two_shot_piece_bytes;
  return s;
}

GroupSegment establish_segment(Rendezvous& rdv, int rank, int world, Config& cfg,
                               const Logger& log) {
  return rank == 0 ? create(rdv, world, cfg) : join(rdv, rank, world, cfg, log);
}

}  // namespace pycomm
