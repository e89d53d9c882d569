#include "core/memory/arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "core/base/errors.h"

namespace pycomm {
namespace {

constexpr size_t kAlign = 64;
constexpr size_t kDefaultSlab = 64ull << 20;
constexpr size_t kHuge = 2ull << 20;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

size_t slab_bytes_from_env() {
  const char* v = std::getenv("PYCOMM_ARENA_SLAB_BYTES");
  if (v == nullptr || *v == '\0') return kDefaultSlab;
  char* end = nullptr;
  unsigned long long x = std::strtoull(v, &end, 10);
  if (end == v || *end != '\0' || x == 0) {
    throw InvalidArgument(std::string("pycomm: PYCOMM_ARENA_SLAB_BYTES=") + v +
                          " is not a positive integer");
  }
  return round_up(x, kHuge);
}

// Never destroyed: tensors freed during interpreter exit must still find it.
Arena* g_arena = nullptr;
std::once_flag g_arena_once;

}  // namespace

Arena& Arena::instance() {
  std::call_once(g_arena_once, [] {
    if (g_arena == nullptr) g_arena = new Arena();
  });
  return *g_arena;
}

// A forked child (single-threaded here) gets an empty arena of its own: the parent's
// allocator state would hand it blocks the parent uses. The parent's slabs it inherited
// become private copy-on-write mappings at the same addresses, so tensors it inherited
// stay readable and what it writes stays its own, as with ordinary memory after fork.
// Their memfds are closed (no peer maps them through the child). Not locked: the
// parent's lock may have been held by a thread that does not exist here.
void Arena::after_fork_in_child() {
  Arena* parent = g_arena;
  g_arena = new Arena();
  if (parent == nullptr) return;
  for (auto& slab : parent->slabs_) {
    mmap(slab->base, slab->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, slab->fd, 0);
    close(slab->fd);
    slab->fd = -1;
  }
}

Arena::Slab* Arena::new_slab(size_t min_bytes) {
  size_t bytes = std::max(slab_bytes_from_env(), round_up(min_bytes, kHuge));
  int fd = memfd_create("pycomm-arena", MFD_CLOEXEC);
  if (fd < 0) throw CommError(std::string("pycomm: memfd_create failed: ") + strerror(errno));
  // Reserve the pages now so that running out of memory is this error, not a SIGBUS.
  int rc = ftruncate(fd, static_cast<off_t>(bytes)) == 0
               ? posix_fallocate(fd, 0, static_cast<off_t>(bytes))
               : errno;
  void* base =
      rc == 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (base == MAP_FAILED) {
    if (rc == 0) rc = errno;
    close(fd);
    throw CommError("pycomm: cannot reserve a " + std::to_string(bytes >> 20) +
                    " MiB shared-memory arena slab: " + strerror(rc) +
                    " (PYCOMM_ARENA_SLAB_BYTES sets the slab size)");
  }
  struct stat st;
  fstat(fd, &st);
  auto slab = std::make_unique<Slab>(Slab{fd,
                                          next_id_++,
                                          static_cast<char*>(base),
                                          bytes,
                                          static_cast<uint64_t>(st.st_dev),
                                          static_cast<uint64_t>(st.st_ino),
                                          {}});
  slab->free[0] = bytes;
  slabs_.push_back(std::move(slab));
  return slabs_.back().get();
}

// First fit: the slabs are few and large, and freed neighbours coalesce, so the free
// lists stay short and memory does not fragment into unusable pieces.
void* Arena::take(Slab& s, size_t bytes) {
  for (auto it = s.free.begin(); it != s.free.end(); ++it) {
    if (it->second < bytes) continue;
    size_t offset = it->first, len = it->second;
    s.free.erase(it);
    if (len > bytes) s.free[offset + bytes] = len - bytes;
    return s.base + offset;
  }
  return nullptr;
}

void Arena::give_back(Slab& s, size_t offset, size_t bytes) {
  auto next = s.free.lower_bound(offset);
  if (next != s.free.end() && offset + bytes == next->first) {
    bytes += next->second;
    next = s.free.erase(next);
  }
  if (next != s.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return;
    }
  }
  s.free[offset] = bytes;
}

static size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// The whole pages inside [offset, offset + bytes): their pages go back to the system for
// every process mapping the slab (a peer's mapping reads zeros there until reused).
size_t Arena::punch(Slab& s, size_t offset, size_t bytes) {
  size_t lo = round_up(offset, page_size());
  size_t hi = (offset + bytes) / page_size() * page_size();
  if (hi <= lo || s.fd < 0) return 0;
  if (fallocate(s.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(lo),
                static_cast<off_t>(hi - lo)) != 0) {
    return 0;  // the memory stays reserved: correct, only not returned
  }
  ever_trimmed_ = true;
  return hi - lo;
}

// A block handed out where pages may have been punched: reserve them now, so running out
// of memory is this error and not a SIGBUS on first touch (as for a new slab).
void Arena::reserve_again(Slab& s, size_t offset, size_t bytes) {
  size_t lo = offset / page_size() * page_size();
  size_t hi = std::min(round_up(offset + bytes, page_size()), s.bytes);
  int rc =
      s.fd < 0 ? 0 : posix_fallocate(s.fd, static_cast<off_t>(lo), static_cast<off_t>(hi - lo));
  if (rc != 0) {
    give_back(s, offset, bytes);
    throw CommError("pycomm: cannot reserve " + std::to_string(bytes >> 20) +
                    " MiB of the shared-memory arena again: " + strerror(rc));
  }
}

void Arena::set_trim_bytes(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  trim_bytes_ = bytes;
}

void* Arena::allocate(size_t bytes) {
  size_t need = round_up(std::max<size_t>(bytes, 1), kAlign);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  Slab* owner = nullptr;
  for (auto& s : slabs_) {
    if ((p = take(*s, need)) != nullptr) {
      owner = s.get();
      break;
    }
  }
  if (p == nullptr) {
    owner = new_slab(need);
    p = take(*owner, need);
  } else if (ever_trimmed_) {
    reserve_again(*owner, static_cast<char*>(p) - owner->base, need);
    trimmed_bytes_ -= std::min(trimmed_bytes_, need);
  }
  live_[static_cast<char*>(p)] = {owner, need};
  live_bytes_ += need;
  peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  return p;
}

bool Arena::release(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(static_cast<char*>(ptr));
  if (it == live_.end()) return false;
  auto [slab, bytes] = it->second;
  size_t offset = static_cast<char*>(ptr) - slab->base;
  give_back(*slab, offset, bytes);
  if (trim_bytes_ > 0 && bytes >= trim_bytes_) trimmed_bytes_ += punch(*slab, offset, bytes);
  live_bytes_ -= bytes;
  live_.erase(it);
  return true;
}

bool Arena::locate(const void* ptr, size_t bytes, ArenaLocation* out) const {
  const char* p = static_cast<const char*>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& s : slabs_) {
    if (p >= s->base && p + bytes <= s->base + s->bytes) {
      *out = ArenaLocation{s->fd,  0,     s->id, s->bytes, static_cast<uint64_t>(p - s->base),
                           s->dev, s->ino};
      return true;
    }
  }
  return false;
}

ArenaStats Arena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ArenaStats st;
  for (const auto& s : slabs_) {
    st.reserved += s->bytes;
    for (const auto& [off, len] : s->free) st.largest_free = std::max(st.largest_free, len);
  }
  st.live = live_bytes_;
  st.trimmed = trimmed_bytes_;
  st.peak = peak_bytes_;
  st.slabs = slabs_.size();
  st.allocations = live_.size();
  return st;
}

}  // namespace pycomm
