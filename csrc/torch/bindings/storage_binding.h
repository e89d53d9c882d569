// Re-pointing a tensor's storage at memory owned by another tensor, for ZeRO stage 3.
//
// A stage-3 parameter is gathered into a slot of a preallocated arena before its layer
// runs and given back afterwards, and the next gather may land in a different slot.
// Autograd keeps views of the parameter (a Linear saves weight.t() for backward), and
// those views hold the parameter's StorageImpl, not its data pointer. Changing the
// StorageImpl's data in place (as FSDP does with storage resize_) therefore moves the
// parameter and every saved view together, while the memory itself stays in the arena.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace pycomm_torch {

// A contiguous tensor of `sizes` whose storage holds no memory yet (nbytes 0).
at::Tensor unbound_tensor(const std::vector<int64_t>& sizes, c10::ScalarType dtype);
// `target`'s storage now reads and writes `source`'s memory (kept alive by it).
void bind_storage(const at::Tensor& target, const at::Tensor& source);
// `target`'s storage holds no memory again (any read of it is a bug, not stale data).
void unbind_storage(const at::Tensor& target);

}  // namespace pycomm_torch
