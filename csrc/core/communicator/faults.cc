#include "core/communicator/faults.h"

namespace pycomm {

std::atomic<uint64_t> Faults::offer_offset_skew{0};
std::atomic<uint64_t> Faults::offer_inode_skew{0};
std::atomic<uint32_t> Faults::buffer_skew{0};

}  // namespace pycomm
