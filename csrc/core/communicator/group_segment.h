// How the ranks of one group come to share one segment, through the job's store: rank 0
// creates it and writes the group's settings into its header; the others check what the
// store names before mapping it (the store is not trusted) and adopt those settings.
// Every rank, joiner or creator, ends up with the same Layout, or with an error that
// names the rank that failed and why; nobody waits out a timeout for a rank that has
// already failed.
#pragma once

#include <string>

#include "core/base/config.h"
#include "core/base/log.h"
#include "core/communicator/rendezvous.h"
#include "core/transport/layout.h"
#include "core/transport/shm_segment.h"

namespace pycomm {

struct GroupSegment {
  ShmSegment segment;
  Layout layout;
};

// Collective over the group. `cfg` is this rank's configuration; on return it holds the
// group's settings (rank 0's), and every setting in which this rank's differed has been
// logged as a warning naming the variable and both values.
GroupSegment establish_segment(Rendezvous& rdv, int rank, int world, Config& cfg,
                               const Logger& log);

// Tells every rank of the group, through the store, that this rank cannot build it
// (so nobody waits out the store's timeout for it). Never throws.
void report_init_failure(Rendezvous& rdv, int rank, const std::string& why);

// The settings rank 0 derives for a group of `world` from its configuration.
GroupSettings group_settings(const Config& cfg, int world);

}  // namespace pycomm
