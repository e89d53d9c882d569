// Whether the other ranks' processes are still alive, without trusting process ids.
//
// Each rank holds an open-file-description (OFD) lock on one byte of a file every rank
// has open (the group's shared segment): byte `rank`. The kernel releases it when the
// process exits, however it exits, so a peer tests the byte: locked means alive. Unlike
// kill(pid, 0) or /proc/<pid>, this works across PID namespaces (containers that share
// /dev/shm but not their process ids) and cannot be fooled by a reused pid.
#pragma once

namespace pycomm {

class Liveness {
 public:
  Liveness() = default;
  // Takes this rank's lock on `fd` (which the caller keeps open). Throws CommError.
  Liveness(int fd, int rank);
  // False once `rank` has exited or closed the file (released the lock); true while it
  // holds it. A rank that never took its lock reads as gone.
  bool alive(int rank) const;
  bool active() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace pycomm
