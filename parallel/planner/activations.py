"""Activation memory of one rank, by Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", sec. 4): what autograd keeps of each layer
for its backward, counted tensor by tensor for this project's models.

Their per-layer total, ``sbh(34 + 5as/h)`` bytes (2-byte activations, 1-byte dropout
masks; ``sbh(10 + 24/t + 5as/(ht))`` with tensor parallelism, ``34sbh/t + 5as^2b/t``
with sequence parallelism, ``2sbh`` with full recompute), becomes in elements of the
activations' dtype (``d`` bytes each) for the project's GPT block:

- replicated over TP (sequence-split under SP): the inputs of ``ln_1``, ``c_attn``,
  ``ln_2`` and ``c_fc``: 4 sbh (Korthikanti's 4 + 2 + 2 + 2 bytes, less their masks);
- split over TP: Q, K, V (3 sbh/t), the attention output (sbh/t, also ``c_proj``'s
  input), ``c_fc``'s output and the GELU's (4 + 4 sbh/t): 12 sbh/t (their 24/t bytes);
- the attention matrix (their ``5as^2b``): none where SDPA runs its fused (flash)
  kernel, as it does on CPU without dropout; with dropout torch takes the math path and
  keeps softmax, mask and dropped scores: ``5as^2b/t`` half-words;
- dropout masks (1 byte, ``2sbh``) only with dropout > 0.

So a GPT block keeps ``d * sbh * (4 + 12/t)`` bytes (fp32: 64 sbh at t = 1: their 32
non-mask half-words of 2 bytes, in 4-byte words). Full recompute keeps only each block's
input (their 2sbh: ``d * sbh``, ``/t`` with ``P_a``) and rebuilds one block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from .shapes import ModelShape

FP32 = 4  # the loss's dtype (and the activations' in fp32)


@dataclass(frozen=True)
class ActShape:
    """One micro-batch on one rank: ``rows`` sequences of ``seq`` tokens."""

    rows: int
    seq: int
    tp: int
    sequence_parallel: bool
    dropout: float
    dtype_bytes: int = 4
    loss_chunk: int = 0  # a tiled head: the loss's vocabulary chunk (0: the loss whole)


def block_saved(m: ModelShape, a: ActShape) -> int:
    """Bytes one block keeps for backward (see the module docstring)."""
    sbh = a.rows * a.seq * m.hidden
    replicated, split = (4, 12) if m.kind == "gpt" else (4, 22)
    # llama: q, k, v, rotated q and k, attention output (6), gate, up, SiLU and the
    # product that feeds down_proj (4 x 4): 22 sbh/t; its norms and projections' inputs
    # replicated as GPT's
    whole = replicated * sbh / (a.tp if a.sequence_parallel else 1)
    out = a.dtype_bytes * (whole + split * sbh / a.tp)
    if a.dropout > 0:
        out += 2 * sbh + 5 * m.heads * a.seq * a.seq * a.rows * 2 / a.tp
    return int(out)


def block_working(m: ModelShape, a: ActShape) -> int:
    """Bytes alive only while one block's backward runs: the MLP's two gradients of
    ``rows x seq x ffn/t`` (of the GELU's output and of its input, both live in the GELU's
    backward) and the gradient flowing into the block (sbh)."""
    sbh = a.rows * a.seq * m.hidden
    return a.dtype_bytes * (2 * a.rows * a.seq * m.ffn // a.tp + sbh)


def checkpoint_kept(m: ModelShape, a: ActShape, partitioned: bool) -> int:
    """Bytes a checkpointed block keeps: its input (``/t`` with ``P_a``), aligned to 64
    bytes as :class:`pycomm.parallel.recompute.saved_inputs.CheckpointArena` places it."""
    numel = a.rows * a.seq * m.hidden
    if partitioned:
        numel = -(-numel // a.tp)
    return -(-numel * a.dtype_bytes // 64) * 64


def head_saved(m: ModelShape, a: ActShape) -> int:
    """The last stage's head: the final norm's and the LM head's inputs (sbh each), the
    logits and the cross-entropy's log-softmax (``rows x seq x vocab/t`` each). The loss
    is taken in fp32 (``pycomm.parallel.precision.widened``): in bf16 or fp16 the logits are
    kept in their dtype and the log-softmax of their fp32 copy in fp32. A tiled head's
    loss (``loss_chunk``) keeps only the logits, in their dtype."""
    sbh = a.rows * a.seq * m.hidden
    logits = a.rows * a.seq * m.vocab // a.tp
    if a.loss_chunk:
        return a.dtype_bytes * (2 * sbh + logits)
    return a.dtype_bytes * 2 * sbh + (a.dtype_bytes + FP32) * logits


def head_working(m: ModelShape, a: ActShape) -> int:
    """The logits' gradient, alive while the head's backward runs: in fp32, and in bf16
    or fp16 its copy in their dtype beside it. A tiled head's loss writes the gradient
    in the logits' dtype, one fp32 chunk (its softmax and the product) at a time."""
    if a.loss_chunk:
        return a.rows * a.seq * (a.dtype_bytes * m.vocab + 2 * FP32 * a.loss_chunk)
    low = a.dtype_bytes if a.dtype_bytes != FP32 else 0
    return (FP32 + low) * a.rows * a.seq * m.vocab // a.tp


def embed_saved(a: ActShape) -> int:
    """The first stage keeps the token ids (int64) for the embedding's backward."""
    return 8 * a.rows * a.seq


def pipeline_messages(m: ModelShape, a: ActShape, pp: int, stage: int,
                      microbatches: int) -> int:
    """Bytes of the pipeline's messages alive at a stage's peak
    (:mod:`pycomm.parallel.pipeline.p2p`): every send holds its tensor until the step's sends
    are waited for at its end (the activations sent on, ``m`` of them, and the
    gradients sent back, ``m - 1`` by the last backward), and one receive from each
    neighbour is posted ahead (sbh each)."""
    sbh = a.dtype_bytes * a.rows * a.seq * m.hidden
    first, last = stage == 0, stage == pp - 1
    sends = (0 if last else microbatches) + (0 if first else microbatches - 1)
    posted = (0 if last else 1) + (0 if first else 1)
    return sbh * (sends + posted)


def in_flight(schedule: str, pp: int, stage: int, microbatches: int) -> int:
    """Micro-batches whose activations one stage holds at once: 1F1B's ``min(p - i, m)``
    (stage i warms up with p - i forwards), GPipe's all ``m``."""
    if schedule == "gpipe":
        return microbatches
    return min(pp - stage, microbatches)
