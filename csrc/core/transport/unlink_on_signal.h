// Names in /dev/shm this process created and has not unlinked yet (a segment waits for
// its peers to map it before its name can go). A fatal signal (SIGTERM: what torchrun
// and schedulers send; SIGHUP, SIGQUIT) would otherwise leave them behind: its handler
// unlinks them, then hands the signal on to whatever handled it before (the default
// disposition ends the process as it would have).
#pragma once

#include <string>

namespace pycomm {

// Registers `shm_name` ("/pycomm-..."); returns a slot for forget(), or -1 when the
// table is full or the name too long (the segment then relies on its destructor).
int unlink_on_signal(const std::string& shm_name);
void forget_unlink_on_signal(int slot);
// In a forked child: the names are the parent's to unlink, not the child's.
void forget_all_unlink_on_signal();

}  // namespace pycomm
