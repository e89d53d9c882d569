// The all_to_all whose receive counts are learned inside the op (expert parallelism's
// dispatch): ProcessGroupPycomm's synchronous entry, and the torch.ops.pycomm operator
// that runs it on a pycomm group and, on any other backend, as two all_to_alls (the
// counts, then the rows) - the same result wherever it runs.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tuple>
#include <vector>

#include "torch/backend/backend.h"
#include "torch/backend/tensor_args.h"

namespace pycomm_torch {
namespace {

constexpr const char* kOp = "all_to_all_counted";

std::string at_rank(int rank) {
  return "pycomm: " + std::string(kOp) + ": rank " + std::to_string(rank);
}

// The counts a caller gives: int64, world x groups, none negative, summing to the rows.
std::vector<uint64_t> checked_counts(const at::Tensor& input, const at::Tensor& counts, int world,
                                     int rank) {
  TORCH_CHECK(input.dim() >= 1, at_rank(rank), ": input must have a row dimension, got a scalar");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 2 && counts.size(0) == world &&
                  counts.size(1) >= 1,
              at_rank(rank), ": send_counts must be int64 of shape (world = ", world,
              ", groups >= 1), got ", counts.scalar_type(), " ", counts.sizes());
  at::Tensor flat = counts.to(at::kCPU).contiguous().reshape(-1);
  const int64_t* c = flat.data_ptr<int64_t>();
  std::vector<uint64_t> out(flat.numel());
  int64_t rows = 0;
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK(c[i] >= 0, at_rank(rank), ": send_counts holds a negative count (", c[i], ")");
    out[i] = static_cast<uint64_t>(c[i]);
    TORCH_CHECK(!__builtin_add_overflow(rows, c[i], &rows), at_rank(rank),
                ": send_counts overflow");
  }
  TORCH_CHECK(rows == input.size(0), at_rank(rank), ": send_counts sum to ", rows,
              " rows but input has ", input.size(0));
  return out;
}

int64_t row_elems_of(const at::Tensor& input) {
  int64_t elems = 1;
  for (int64_t d = 1; d < input.dim(); ++d) elems *= input.size(d);
  return elems;
}

// On any backend: the counts first (one all_to_all of groups int64 per peer), then the
// rows with the splits they give.
std::tuple<at::Tensor, at::Tensor> counted_over(c10d::Backend& backend, const at::Tensor& input,
                                                const at::Tensor& send_counts) {
  const int world = backend.getSize();
  checked_counts(input, send_counts, world, backend.getRank());
  at::Tensor send = send_counts.contiguous();
  at::Tensor recv = at::empty_like(send);
  std::vector<int64_t> equal;
  c10d::AllToAllOptions opts;
  backend.alltoall_base(recv, send, equal, equal, opts)->wait();
  std::vector<int64_t> in_splits, out_splits;
  at::Tensor sent_rows = send.sum(1), recv_rows = recv.sum(1);
  for (int q = 0; q < world; ++q) {
    in_splits.push_back(sent_rows[q].item<int64_t>());
    out_splits.push_back(recv_rows[q].item<int64_t>());
  }
  int64_t total = 0;
  for (int64_t r : out_splits) total += r;
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] = total;
  at::Tensor out = at::empty(shape, input.options());
  at::Tensor in = input.contiguous();
  backend.alltoall_base(out, in, out_splits, in_splits, opts)->wait();
  return {out, recv};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ProcessGroupPycomm::all_to_all_counted(
    const at::Tensor& input, const at::Tensor& send_counts) {
  const int world = getSize();
  TORCH_CHECK(input.device().is_cpu(), at_rank(getRank()),
              ": pycomm's shared-memory path takes "
              "CPU tensors, got ",
              input.device());
  pycomm::DType dt = checked_dtype(input, kOp, getRank());
  auto args = std::make_shared<pycomm::CountedAllToAllArgs>();
  args->send_counts = checked_counts(input, send_counts, world, getRank());
  args->dtype = dt;
  args->row_elems = static_cast<size_t>(row_elems_of(input));
  args->groups = static_cast<size_t>(send_counts.size(1));
  // More counts than the offer holds (hundreds of experts per rank at the default
  // direct area): the counts go first, as on any other backend.
  if (!comm().counted_fits(args->groups)) return counted_over(*this, input, send_counts);
  auto result = std::make_shared<std::tuple<at::Tensor, at::Tensor>>();
  at::Tensor in = input.contiguous();
  std::vector<int64_t> shape = input.sizes().vec();
  const auto options = input.options();
  c10d::AllToAllOptions opts;
  opts.asyncOp = false;
  auto work = enqueue(c10d::OpType::ALLTOALL_BASE, "pycomm:all_to_all_counted", {}, false,
                      [this, args, result, in, shape, options, world]() mutable {
                        args->in = in.data_ptr();
                        args->allocate = [&](const std::vector<uint64_t>& recv) -> void* {
                          at::Tensor counts =
                              at::empty({world, static_cast<int64_t>(args->groups)}, at::kLong);
                          uint64_t rows = 0;
                          for (size_t i = 0; i < recv.size(); ++i) {
                            counts.data_ptr<int64_t>()[i] = static_cast<int64_t>(recv[i]);
                            rows += recv[i];
                          }
                          shape[0] = static_cast<int64_t>(rows);
                          std::get<0>(*result) = at::empty(shape, options);
                          std::get<1>(*result) = counts;
                          return std::get<0>(*result).data_ptr();
                        };
                        comm().all_to_all_counted(*args);
                        args->allocate = nullptr;
                      });
  work->wait();
  return *result;
}

namespace {

std::tuple<at::Tensor, at::Tensor> all_to_all_counted_op(const at::Tensor& input,
                                                         const at::Tensor& send_counts,
                                                         c10::string_view group_name) {
  auto group = c10d::resolve_process_group(std::string(group_name));
  auto backend = group->getBackend(input.device().type());
  auto* ours = dynamic_cast<ProcessGroupPycomm*>(backend.get());
  if (ours != nullptr && input.device().is_cpu())
    return ours->all_to_all_counted(input, send_counts);
  return counted_over(*backend, input, send_counts);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pycomm, m) {
  m.def("all_to_all_counted(Tensor input, Tensor send_counts, str group_name) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pycomm, CompositeExplicitAutograd, m) {
  m.impl("all_to_all_counted", all_to_all_counted_op);
}

}  // namespace pycomm_torch
