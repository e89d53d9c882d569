#include "core/runtime/group_segment.h"

#include <cstdlib>
#include <thread>
#include <vector>

#include "core/runtime/errors.h"
#include "core/transport/shared_state.h"

namespace pycomm {
namespace {

const char* kSegmentKey = "segment";
std::string opened_key(int r) { return "opened/" + std::to_string(r); }

std::string mib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", bytes / 1048576.0);
  return buf;
}

// Oversubscribed ranks (more ranks than cores): the direct algorithm takes one step
// where the ring takes 2(n-1), but reads every rank's whole message. Measured here
// (bench/README.md): with a core per rank the ring wins from 64 KiB up, so direct stops
// at 16 KiB; oversubscribed, every ring step waits for a descheduled peer and direct
// wins up to 64 KiB.
size_t direct_bytes_for(const Config& cfg, int world) {
  if (std::getenv("PYCOMM_DIRECT_BYTES") != nullptr) return cfg.direct_bytes;
  unsigned cores = std::thread::hardware_concurrency();
  bool oversubscribed = cores != 0 && static_cast<unsigned>(world) > cores;
  return oversubscribed ? 64 << 10 : 16 << 10;
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
  return out;
}

// The header of a segment another rank created, checked against what was announced
// before any offset derived from it is used.
Layout checked_layout(const ShmSegment& seg, size_t total, int world, int rank) {
  const auto* h = static_cast<const SegmentHeader*>(seg.data());
  const GroupSettings& s = h->settings;
  std::string why;
  if (h->magic != kSegmentMagic)
    why = "its header is not a pycomm v2 header (another version of pycomm on rank 0?)";
  else if (h->world != world)
    why = "it is for " + std::to_string(h->world) + " ranks, not " + std::to_string(world);
  else if (h->total_bytes != total)
    why = "its header says " + std::to_string(h->total_bytes) + " bytes, the store " +
          std::to_string(total);
  else if (s.slots < 2 || s.slots > 64 || s.slot_bytes < 64 || s.slot_bytes % 64 != 0 ||
           s.slot_bytes > (1ull << 40) || s.direct_bytes > (1ull << 30) || s.zero_copy > 1 ||
           s.algo > static_cast<uint32_t>(Algo::DIRECT))
    why = "its settings are out of range";
  else if (Layout(world, s.slots, s.slot_bytes, s.direct_bytes).total_bytes() != total)
    why = "its settings describe a layout of another size";
  if (!why.empty()) {
    throw CommError("pycomm: rank " + std::to_string(rank) + " refuses segment " + seg.name() +
                    ": " + why);
  }
  return Layout(world, s.slots, s.slot_bytes, s.direct_bytes);
}

void apply(const GroupSettings& s, Config& cfg) {
  cfg.slots = s.slots;
  cfg.chunk_bytes = s.slot_bytes;
  cfg.direct_bytes = s.direct_bytes;
  cfg.algo = static_cast<Algo>(s.algo);
  cfg.zero_copy = s.zero_copy != 0;
}

GroupSegment create(Rendezvous& rdv, int world, Config& cfg) {
  GroupSettings s = group_settings(cfg, world);
  apply(s, cfg);
  Layout layout(world, s.slots, s.slot_bytes, s.direct_bytes);
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
  for (int r = 1; r < world; ++r) {
    std::string v = rdv.get(opened_key(r));
    if (v.rfind("error ", 0) == 0 && failed.empty())
      failed = "rank " + std::to_string(r) + " could not join: " + v.substr(6);
  }
  // Every rank has it mapped (or gave up): the name can go, and so can the keys.
  g.segment.unlink();
  rdv.remove(kSegmentKey);
  for (int r = 1; r < world; ++r) rdv.remove(opened_key(r));
  if (!failed.empty()) {
    // The ranks that did join must not wait for this one at their first op.
    std::string msg = "pycomm: rank 0: the group cannot start: " + failed;
    Shared(g.segment, layout, 0, world).set_abort(msg);
    throw CommError(msg);
  }
  return g;
}

GroupSegment join(Rendezvous& rdv, int rank, int world, Config& cfg, const Logger& log) {
  GroupSettings mine = group_settings(cfg, world);
  SegmentRecord rec = parse_record(rdv.get(kSegmentKey), rank);
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
    return GroupSegment{std::move(seg), layout};
  } catch (const std::exception& e) {
    rdv.set(opened_key(rank), std::string("error ") + e.what());
    throw;
  }
}

}  // namespace

GroupSettings group_settings(const Config& cfg, int world) {
  GroupSettings s{};
  s.slots = cfg.slots;
  s.algo = static_cast<uint32_t>(cfg.algo);
  s.slot_bytes = cfg.chunk_bytes;
  s.direct_bytes = direct_bytes_for(cfg, world);
  s.zero_copy = cfg.zero_copy ? 1 : 0;
  return s;
}

GroupSegment establish_segment(Rendezvous& rdv, int rank, int world, Config& cfg,
                               const Logger& log) {
  return rank == 0 ? create(rdv, world, cfg) : join(rdv, rank, world, cfg, log);
}

}  // namespace pycomm
