#include "core/transport/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>

#include "core/base/errors.h"
#include "core/communicator/fork_guard.h"
#include "core/transport/unlink_on_signal.h"

namespace pycomm {
namespace {

constexpr const char* kPrefix = "/pycomm-";

std::string random_name() {
  std::random_device rd;
  uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[64];
  snprintf(buf, sizeof(buf), "%s%d-%016llx", kPrefix, static_cast<int>(getpid()),
           static_cast<unsigned long long>(r));
  return buf;
}

std::string mib(size_t bytes) { return std::to_string((bytes + (1 << 20) - 1) >> 20) + " MiB"; }

void* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw CommError("pycomm: mmap of shared-memory segment " + name + " (" + mib(bytes) +
                    ") failed: " + strerror(errno));
  }
  return p;
}

// What open() requires of a file before mapping it; "" if it qualifies.
std::string unfit(int fd, size_t bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) return std::string("fstat failed: ") + strerror(errno);
  if (!S_ISREG(st.st_mode)) return "it is not a regular file";
  if (st.st_uid != geteuid()) {
    return "it is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
           std::to_string(geteuid()) + ")";
  }
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return std::string("its mode ") + mode + " lets other users in (expected 0600)";
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    return "it holds " + std::to_string(st.st_size) + " bytes, less than the " +
           std::to_string(bytes) + " announced";
  }
  return "";
}

}  // namespace

size_t shm_free_bytes() {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) return SIZE_MAX;
  return static_cast<size_t>(st.f_bavail) * st.f_frsize;
}

bool is_segment_name(const std::string& name) {
  const std::string prefix = kPrefix;
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  size_t dash = name.find('-', prefix.size());
  if (dash == std::string::npos || dash == prefix.size() || name.size() - dash - 1 != 16)
    return false;
  for (size_t i = prefix.size(); i < dash; ++i)
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return false;
  for (size_t i = dash + 1; i < name.size(); ++i)
    if (!std::isxdigit(static_cast<unsigned char>(name[i]))) return false;
  return true;
}

ShmSegment ShmSegment::create(size_t bytes, size_t eager_bytes, const std::string& what) {
  size_t free_bytes = shm_free_bytes();
  if (eager_bytes > free_bytes) {
    throw CommError("pycomm: /dev/shm has " + mib(free_bytes) + " free but " + what + " needs " +
                    mib(eager_bytes) + " (" + std::to_string(eager_bytes) +
                    " bytes). Enlarge /dev/shm (e.g. docker run --shm-size=" +
                    mib(eager_bytes * 2) + ") or lower PYCOMM_CHUNK_BYTES / PYCOMM_SLOTS.");
  }
  ShmSegment seg;
  seg.name_ = random_name();
  seg.fd_ = shm_open(seg.name_.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (seg.fd_ < 0) {
    throw CommError("pycomm: shm_open(" + seg.name_ + ") failed: " + strerror(errno));
  }
  seg.linked_ = true;
  seg.signal_slot_ = unlink_on_signal(seg.name_);
  if (ftruncate(seg.fd_, static_cast<off_t>(bytes)) != 0) {
    throw CommError("pycomm: cannot size shared-memory segment " + seg.name_ + " to " + mib(bytes) +
                    ": " + strerror(errno));
  }
  seg.data_ = map_fd(seg.fd_, bytes, seg.name_);
  seg.size_ = bytes;
  seg.fork_slot_ = close_on_fork(seg.fd_, seg.data_, bytes);
  seg.reserve(0, eager_bytes, what);
  return seg;  // on a throw above, ~ShmSegment unlinks, unmaps and closes
}

// posix_fallocate allocates the pages now: on tmpfs a hole that is first touched when
// /dev/shm is full kills the process with SIGBUS.
void ShmSegment::reserve(size_t offset, size_t bytes, const std::string& what) const {
  if (bytes == 0) return;
  // A range larger than what is free would be allocated page by page before failing.
  const size_t free_bytes = shm_free_bytes();
  int rc = bytes > free_bytes ? ENOSPC : 0;
  if (rc == 0) rc = posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  if (rc != 0) {
    throw CommError("pycomm: could not reserve " + mib(bytes) + " in /dev/shm for " + what + " (" +
                    strerror(rc) + "); /dev/shm has " + mib(shm_free_bytes()) +
                    " free. Enlarge /dev/shm (docker run --shm-size=...) or lower "
                    "PYCOMM_CHUNK_BYTES / PYCOMM_SLOTS.");
  }
}

bool ShmSegment::try_reserve(size_t offset, size_t bytes, size_t keep_free) const {
  const size_t free_bytes = shm_free_bytes();
  if (free_bytes < keep_free || free_bytes - keep_free < bytes) return false;
  return posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes)) == 0;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  if (!is_segment_name(name)) {
    throw CommError("pycomm: refusing to map shared-memory segment '" + name +
                    "': not a name pycomm creates (/pycomm-<pid>-<16 hex digits>)");
  }
  ShmSegment seg;
  seg.fd_ = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (seg.fd_ < 0) {
    throw CommError("pycomm: cannot open shared-memory segment " + name + ": " + strerror(errno) +
                    " (are all ranks on one host, sharing /dev/shm? set PYCOMM_LOCAL_SIZE "
                    "to simulate hosts)");
  }
  seg.name_ = name;
  std::string why = unfit(seg.fd_, bytes);
  if (!why.empty()) {
    throw CommError("pycomm: refusing to map shared-memory segment " + name + ": " + why);
  }
  seg.data_ = map_fd(seg.fd_, bytes, name);
  seg.size_ = bytes;
  seg.fork_slot_ = close_on_fork(seg.fd_, seg.data_, bytes);
  return seg;
}

ShmSegment::ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    unlink();
    unmap();
    name_ = std::move(o.name_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    fd_ = std::exchange(o.fd_, -1);
    linked_ = std::exchange(o.linked_, false);
    signal_slot_ = std::exchange(o.signal_slot_, -1);
    fork_slot_ = std::exchange(o.fork_slot_, -1);
  }
  return *this;
}

ShmSegment::~ShmSegment() {
  unlink();
  unmap();
}

void ShmSegment::unlink() {
  if (linked_) {
    forget_unlink_on_signal(std::exchange(signal_slot_, -1));
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void ShmSegment::unmap() {
  forget_close_on_fork(std::exchange(fork_slot_, -1));
  if (data_ != nullptr) {
    munmap(data_, size_);
    data_ = nullptr;
  }
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
}

}  // namespace pycomm
