// Error types of the core; the torch layer maps them onto torch's Python exceptions.
#pragma once

#include <stdexcept>
#include <string>

namespace pycomm {

// Bad arguments from the caller (unsupported dtype/op, wrong sizes): a ValueError.
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// The job cannot go on: a timeout, a dead peer, ranks that disagree, an aborted
// communicator. Surfaces as torch.distributed.DistBackendError.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace pycomm
