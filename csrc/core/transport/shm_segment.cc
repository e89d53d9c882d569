#include "core/transport/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>

#include "core/runtime/errors.h"

namespace pycomm {
namespace {

std::string random_name() {
  std::random_device rd;
  uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[64];
  snprintf(buf, sizeof(buf), "/pycomm-%d-%016llx", static_cast<int>(getpid()),
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

}  // namespace

size_t shm_free_bytes() {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) return SIZE_MAX;
  return static_cast<size_t>(st.f_bavail) * st.f_frsize;
}

ShmSegment ShmSegment::create(size_t bytes, const std::string& what) {
  size_t free_bytes = shm_free_bytes();
  if (bytes > free_bytes) {
    throw CommError("pycomm: /dev/shm has " + mib(free_bytes) + " free but " + what + " needs " +
                    mib(bytes) + " (" + std::to_string(bytes) +
                    " bytes). Enlarge /dev/shm (e.g. docker run --shm-size=" + mib(bytes * 2) +
                    ") or lower PYCOMM_CHUNK_BYTES / PYCOMM_SLOTS.");
  }
  ShmSegment seg;
  seg.name_ = random_name();
  int fd = shm_open(seg.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throw CommError("pycomm: shm_open(" + seg.name_ + ") failed: " + strerror(errno));
  }
  seg.linked_ = true;
  // posix_fallocate reserves the pages now: on tmpfs a plain ftruncate would succeed and
  // the first touch of a missing page would kill the process with SIGBUS.
  int rc = ftruncate(fd, static_cast<off_t>(bytes));
  if (rc == 0)
    rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  else
    rc = errno;
  if (rc != 0) {
    close(fd);
    seg.unlink();
    throw CommError("pycomm: could not reserve " + mib(bytes) + " in /dev/shm for " + what + " (" +
                    strerror(rc) + "); /dev/shm has " + mib(shm_free_bytes()) +
                    " free. Enlarge /dev/shm or lower PYCOMM_CHUNK_BYTES / PYCOMM_SLOTS.");
  }
  try {
    seg.data_ = map_fd(fd, bytes, seg.name_);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  seg.size_ = bytes;
  return seg;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    throw CommError("pycomm: cannot open shared-memory segment " + name + ": " + strerror(errno) +
                    " (are all ranks on one host? set PYCOMM_LOCAL_SIZE)");
  }
  ShmSegment seg;
  seg.name_ = name;
  try {
    seg.data_ = map_fd(fd, bytes, name);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  seg.size_ = bytes;
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
    linked_ = std::exchange(o.linked_, false);
  }
  return *this;
}

ShmSegment::~ShmSegment() {
  unlink();
  unmap();
}

void ShmSegment::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void ShmSegment::unmap() {
  if (data_ != nullptr) {
    munmap(data_, size_);
    data_ = nullptr;
  }
}

}  // namespace pycomm
