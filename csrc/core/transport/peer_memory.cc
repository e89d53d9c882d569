#include "core/transport/peer_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "core/runtime/errors.h"

namespace pycomm {

PeerMemory::~PeerMemory() {
  for (auto& [key, map] : maps_) munmap(map.first, map.second);
}

char* PeerMemory::resolve(int rank, const ArenaLocation& loc) {
  auto key = std::make_pair(rank, loc.slab_id);
  auto it = maps_.find(key);
  if (it == maps_.end()) {
    int pid = shared_.control(rank)->pid.load(std::memory_order_acquire);
    std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(loc.fd);
    int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    void* base = fd < 0 ? MAP_FAILED
                        : mmap(nullptr, loc.slab_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    if (fd >= 0) close(fd);
    if (base == MAP_FAILED) {
      throw CommError("pycomm: rank " + std::to_string(shared_.rank()) +
                      " cannot map the arena memory of rank " + std::to_string(rank) + " (" + path +
                      "): " + strerror(err) +
                      "; zero-copy needs both ranks in one PID namespace with access to "
                      "each other's /proc (set PYCOMM_ZERO_COPY=0 to turn it off)");
    }
    it = maps_.emplace(key, std::make_pair(static_cast<char*>(base), size_t(loc.slab_bytes))).first;
  }
  return it->second.first + loc.offset;
}

}  // namespace pycomm
