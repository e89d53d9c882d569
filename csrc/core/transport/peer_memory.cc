#include "core/transport/peer_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "core/base/errors.h"

namespace pycomm {

PeerMemory::~PeerMemory() {
  for (auto& [key, map] : maps_) munmap(map.base, map.bytes);
}

void PeerMemory::refuse(int rank, const std::string& why) const {
  throw CommError("pycomm: rank " + std::to_string(shared_.rank()) +
                  " cannot use the arena memory of rank " + std::to_string(rank) + ": " + why);
}

PeerMemory::Mapping PeerMemory::map_slab(int rank, const ArenaLocation& loc) {
  int pid = shared_.control(rank)->pid.load(std::memory_order_acquire);
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(loc.fd);
  int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    refuse(rank, path + ": " + strerror(errno) +
                     " (zero-copy needs both ranks in one PID namespace with access to each "
                     "other's /proc; set PYCOMM_ZERO_COPY=0 to turn it off)");
  }
  struct stat st;
  bool same = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
              static_cast<uint64_t>(st.st_dev) == loc.dev &&
              static_cast<uint64_t>(st.st_ino) == loc.ino &&
              static_cast<uint64_t>(st.st_size) == loc.slab_bytes;
  void* base =
      same ? mmap(nullptr, loc.slab_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  int err = errno;
  close(fd);
  if (!same) {
    refuse(rank, path +
                     " is not the slab it posted (another process's file: are the ranks "
                     "in different PID namespaces?)");
  }
  if (base == MAP_FAILED) refuse(rank, "mmap of " + path + ": " + strerror(err));
  return Mapping{static_cast<char*>(base), static_cast<size_t>(loc.slab_bytes), loc.dev, loc.ino};
}

char* PeerMemory::resolve(int rank, const ArenaLocation& loc, size_t bytes) {
  auto key = std::make_pair(rank, loc.slab_id);
  auto it = maps_.find(key);
  if (it == maps_.end()) it = maps_.emplace(key, map_slab(rank, loc)).first;
  const Mapping& m = it->second;
  if (m.dev != loc.dev || m.ino != loc.ino || m.bytes != loc.slab_bytes) {
    refuse(rank, "it posted slab " + std::to_string(loc.slab_id) +
                     " with another identity or size than before");
  }
  if (loc.offset > m.bytes || bytes > m.bytes - loc.offset) {
    refuse(rank, "it posted " + std::to_string(bytes) + " bytes at offset " +
                     std::to_string(loc.offset) + " of a " + std::to_string(m.bytes) +
                     "-byte slab");
  }
  return m.base + loc.offset;
}

}  // namespace pycomm
