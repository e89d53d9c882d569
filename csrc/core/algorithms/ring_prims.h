// The steps ring and chain algorithms are made of, as NCCL names them: each receives a
// chunk from `prev` and/or sends one to `next`, one slot at a time, reducing or copying
// on the way. A Piece names where the chunk sits in the op's message, which the receiver
// checks against its own expectation. Which primitive each step of a ring or chain is
// comes from its plan (ring_plan.h, walked by walk_ring_cpu).
#pragma once

#include <cstddef>

#include "core/base/types.h"
#include "core/transport/transport.h"

namespace pycomm {

struct Piece {
  size_t offset;  // first element within the message
  size_t count;   // elements
};

class Prims {
 public:
  // `msg_elems` is the size of the whole message (checked by receivers); `op` and
  // `scale` are used by the reducing steps (scale only where a step says "final").
  Prims(Transport& t, const OpCall& op, DType dtype, int prev, int next, size_t msg_elems,
        RedOp redop = RedOp::NONE, double scale = 1.0);

  void send(const void* src, Piece p);
  // send, then src also copied to dst (skipped when they are one): a rank's own block,
  // sent on and kept.
  void copy_send(const void* src, void* dst, Piece p);
  void recv_reduce_send(const void* mine, Piece p);
  // dst = scale * (incoming op mine), also sent on: the final value of a reduction.
  void recv_reduce_copy_send(const void* mine, void* dst, Piece p);
  void recv_reduce_copy(const void* mine, void* dst, Piece p);
  void recv_copy_send(void* dst, Piece p);
  void recv_copy(void* dst, Piece p);

 private:
  const void* recv(Piece p);
  void* slot();
  void publish(Piece p);
  void done_recv();

  Transport& t_;
  const OpCall& op_;
  DType dtype_;
  size_t esize_;
  int prev_, next_;
  size_t msg_bytes_;
  RedOp redop_;
  double scale_;
};

}  // namespace pycomm
