#include "core/transport/liveness.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "core/base/errors.h"

namespace pycomm {
namespace {

struct flock byte_of(int rank, short type) {
  struct flock fl;
  std::memset(&fl, 0, sizeof(fl));
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = rank;
  fl.l_len = 1;
  fl.l_pid = 0;  // required by F_OFD_*
  return fl;
}

}  // namespace

Liveness::Liveness(int fd, int rank) : fd_(fd) {
  struct flock fl = byte_of(rank, F_WRLCK);
  if (fcntl(fd_, F_OFD_SETLK, &fl) != 0) {
    throw CommError("pycomm: rank " + std::to_string(rank) +
                    " cannot lock its byte of the group's segment (" + strerror(errno) +
                    "): is another process using rank " + std::to_string(rank) + "?");
  }
}

bool Liveness::alive(int rank) const {
  if (fd_ < 0) return true;
  struct flock fl = byte_of(rank, F_WRLCK);
  if (fcntl(fd_, F_OFD_GETLK, &fl) != 0) return true;  // cannot tell: assume alive
  return fl.l_type != F_UNLCK;
}

}  // namespace pycomm
