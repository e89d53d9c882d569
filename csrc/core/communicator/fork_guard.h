// fork() copies one thread and every mapping: a forked child (a fork-started DataLoader
// worker, a subprocess started by fork) would share the arena's MAP_SHARED slabs and
// allocator state with its parent, hold the parent's liveness locks (so the parent's
// death would look like life), and find no worker threads behind its groups. So in the
// child (pthread_atfork): the arena starts afresh and the parent's slabs become private
// copies, the liveness files are closed, and nothing the parent registered for signal
// cleanup is unlinked by the child. A group the child inherited refuses every op with
// an error saying so, and lets go of nothing at exit (its threads and its rank belong
// to the parent).
#pragma once

#include <cstddef>
#include <string>

namespace pycomm {

// Installs the child handler (idempotent; the extension calls it when it loads).
void install_fork_guard();

// Keeps a file (a liveness lock's segment) from outliving a fork: the child closes `fd`
// and unmaps [addr, addr + bytes) (a mapping holds the file open too). Returns a slot
// for forget_close_on_fork (-1 when the table is full).
int close_on_fork(int fd, void* addr, size_t bytes);
void forget_close_on_fork(int slot);

// What an op on a group created by process `creator_pid` says in a forked child ("" in
// the process that created it).
std::string forked_group_error(int creator_pid, int rank);

}  // namespace pycomm
