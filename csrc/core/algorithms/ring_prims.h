// The steps ring and chain algorithms are made of, as NCCL names them: each receives a
// chunk from `prev` and/or sends one to `next`, one slot at a time, reducing or copying
// on the way. A Piece names where the chunk sits in the op's message, which the receiver
// checks against its own expectation.
#pragma once

#include <cstddef>

#include "core/runtime/types.h"
#include "core/transport/transport.h"

namespace pycomm {

struct Piece {
  size_t offset;  // first element within the message
  size_t count;   // elements
};

// `count` elements cut into `parts` near-equal parts (the first count % parts are one
// longer), each walked in rounds of at most `chunk_elems`.
class Partition {
 public:
  Partition(size_t count, int parts, size_t chunk_elems);
  size_t rounds() const { return rounds_; }
  size_t begin(int part) const;
  size_t size(int part) const;
  // The round-th chunk of part `part` (taken modulo parts, so r - 1 - k works).
  Piece piece(long part, size_t round) const;

 private:
  size_t count_, base_, rem_, chunk_, rounds_;
  int parts_;
};

class Prims {
 public:
  // `msg_elems` is the size of the whole message (checked by receivers); `op` and
  // `scale` are used by the reducing steps (scale only where a step says "final").
  Prims(Transport& t, const OpCall& op, DType dtype, int prev, int next, size_t msg_elems,
        RedOp redop = RedOp::NONE, double scale = 1.0);

  void send(const void* src, Piece p);
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
