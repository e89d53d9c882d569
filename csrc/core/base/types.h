// Element types, reduction ops and collective kinds, with the names used in messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pycomm {

enum class DType : uint32_t { F32, F64, F16, BF16, I8, U8, I32, I64, BOOL };
enum class RedOp : uint32_t { SUM, AVG, PROD, MIN, MAX, BAND, BOR, BXOR, NONE };
enum class OpKind : uint32_t {
  ALL_REDUCE,
  BROADCAST,
  REDUCE,
  ALL_GATHER,
  REDUCE_SCATTER,
  ALL_TO_ALL,
  GATHER,
  SCATTER,
  BARRIER,
  SEND,
  ALL_TO_ALL_COUNTED,  // count: elements per row
};

size_t dtype_size(DType t);
bool is_floating(DType t);
const char* dtype_name(DType t);
const char* redop_name(RedOp op);
const char* opkind_name(OpKind k);

// What one rank called for one sequence number. Every message carries it, so a
// receiver can tell exactly how the sender's call differs from its own.
struct OpDesc {
  uint64_t seq = 0;
  OpKind kind = OpKind::BARRIER;
  DType dtype = DType::U8;
  uint64_t count = 0;  // elements per rank (all_to_all: 0, sizes are checked per pair)
  RedOp op = RedOp::NONE;
  int32_t root = -1;  // root for rooted collectives, tag for send/recv
};

// "all_reduce float32[1000] SUM" — the part of a call that must agree across ranks.
std::string describe(const OpDesc& d);
bool same_call(const OpDesc& a, const OpDesc& b);

// Whether some pycomm rank could have published `d`: a sequence number from 1, a kind,
// dtype and op that exist, and a count whose bytes fit a host (a descriptor a peer
// publishes is read from shared memory that anything of the same user can write).
bool publishable(const OpDesc& d);
// The message for rank `peer`'s `word` (a descriptor it published) that no pycomm rank
// could have: its raw fields, and that the segment was written by something else.
std::string unpublishable(int peer, const char* word, const OpDesc& d);

}  // namespace pycomm
