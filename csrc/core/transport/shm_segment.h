// A POSIX shared-memory segment private to one job: mode 0600, a random name, fully
// reserved up front (so a small /dev/shm fails here with a clear message instead of a
// SIGBUS later), and unlinked as soon as every rank has it mapped.
#pragma once

#include <cstddef>
#include <string>

namespace pycomm {

class ShmSegment {
 public:
  // Creates and maps a new segment named "/pycomm-<random>". Throws CommError if
  // /dev/shm cannot hold `bytes`, naming how much it needs and has.
  static ShmSegment create(size_t bytes, const std::string& what);
  // Maps an existing segment created by another rank.
  static ShmSegment open(const std::string& name, size_t bytes);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  // Removes the name from /dev/shm; the mapping stays valid until unmapped.
  void unlink();
  void unmap();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool linked_ = false;
};

// Bytes free in /dev/shm (statvfs), or SIZE_MAX when it cannot be read.
size_t shm_free_bytes();

}  // namespace pycomm
