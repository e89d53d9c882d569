// A POSIX shared-memory segment private to one job: mode 0600, a random name, and
// unlinked as soon as every rank has it mapped. The creator reserves the pages it will
// use at once (reserve(): so a small /dev/shm fails with a clear message instead of a
// SIGBUS later); the rest of the file stays a hole until reserve() is asked for it.
// Each process keeps its descriptor open: the ranks' liveness locks live on it.
#pragma once

#include <cstddef>
#include <string>

namespace pycomm {

class ShmSegment {
 public:
  // Creates and maps a new segment "/pycomm-<pid>-<16 hex>" of `bytes` (a hole), and
  // reserves its first `eager_bytes`. Throws CommError if /dev/shm cannot hold them,
  // naming how much it needs and has.
  static ShmSegment create(size_t bytes, size_t eager_bytes, const std::string& what);
  // Maps an existing segment created by another rank of this job. Only a name that
  // create() makes is accepted, of a file owned by this user, readable by nobody else,
  // and at least `bytes` long (the store that names it is not trusted).
  static ShmSegment open(const std::string& name, size_t bytes);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  // Allocates the pages of [offset, offset + bytes) now (idempotent). Throws CommError
  // naming `what` and the sizes when /dev/shm is full.
  void reserve(size_t offset, size_t bytes, const std::string& what) const;
  // Allocates them only if /dev/shm would still have `keep_free` bytes free after;
  // whether it did. For memory that is useful but not needed (a deeper channel).
  bool try_reserve(size_t offset, size_t bytes, size_t keep_free) const;
  // Removes the name from /dev/shm; the mapping stays valid until unmapped.
  void unlink();
  // Unmaps and closes (releasing this process's locks on the file).
  void unmap();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
  bool linked_ = false;
  int signal_slot_ = -1;
  int fork_slot_ = -1;  // the child of a fork closes fd_ (its liveness locks: fork_guard.h)  //
                        // while linked: unlinked by a fatal signal (unlink_on_signal.h)
};

// Bytes free in /dev/shm (statvfs), or SIZE_MAX when it cannot be read.
size_t shm_free_bytes();
// Whether `name` is one create() could have made ("/pycomm-<pid>-<16 hex digits>").
bool is_segment_name(const std::string& name);

}  // namespace pycomm
