"""Predicted per-rank memory of a layout, term by term, as this project allocates it.

The model states follow the ZeRO paper (Rajbhandari et al. 2020, sec. 3): with Adam and
``Psi`` parameters, ``2Psi + 2Psi + K Psi`` bytes (fp16 parameters and gradients, K = 12
of fp32 master, momentum and variance) split per stage over ``N_d``: stage 1
``4Psi + K Psi/N_d``, stage 2 ``2Psi + (2 + K)Psi/N_d``, stage 3 ``(4 + K)Psi/N_d``.
The trainer computes in fp32 with the parameters as their own masters, so here
``4Psi + 4Psi + 8Psi = 16Psi`` (stage 0), ``8Psi + 8Psi/N`` (1), ``4Psi + 12Psi/N`` (2),
``16Psi/N`` (3), ``Psi`` being this rank's part of the model (its pipeline stage, its
tensor-parallel part), each over the flat layouts' 64-byte-aligned sizes, plus the
buffers the project holds beside them:

- stage 0: the gradients are views of the averaging arena (no bucket copies);
- stages 1-2, reducing after backward (the composed engine), hold a whole gradient's
  worth beside the states at its end (``end_of_backward``): stage 2 in each bucket's
  buffer (taken at the bucket's first gradient, given back once reduce-scattered),
  stage 1 in the ``.grad`` tensors autograd allocates (``zero_grad`` set them to None)
  until ``reduce_gradients`` copies them into its arena; the layers already through
  backward have theirs beside each block's backward;
- stage 3: parameters under the persistence threshold (100k elements) form one
  persistent unit, a tie across pipeline stages a unit on each stage; every unit's
  gathered parameters and gradients come from a pool of whole-unit buffers
  (:class:`pycomm.parallel.zero.slot_pool.SlotPool`, one size per unit) that keeps the most
  it ever handed out at once (``zero3 pool``; under ``max_live_bytes`` the budget, or
  what the unit in use needs where that is more: its parameters, the gradient being
  filled and the two being reduced);
- recompute: the checkpointed inputs live in one arena that keeps its largest size;
- a pipeline's sends hold their tensors until the step ends (``pipeline messages``);
- a mixture of experts' fused experts tensors at ep > 1 (``Memory.experts``; at ep = 1
  they are dense parameters, split over tp), ``E / ep`` of the experts per rank, beside
  ZeRO, never gathered by it. Where ``edp = dp / ep`` ranks hold the same experts,
  their own ZeRO over ``edp`` (stage 2 under stage 3) shards their gradients and state
  as the dense ones' are sharded over ``dp``; with ``edp = 1`` (or ZeRO 0) they are
  stage 0's whole states.

Activations (:mod:`pycomm.parallel.planner.activations`) peak either while the head's backward
runs or while a block's does (the largest of those phases).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..compose.tiles import row_bounds
from ..zero.offload import MAX_WRITES
from ..zero.plan_units import OWN_UNIT_NUMEL
from ..zero.shard_layout import ShardLayout
from ..zero.sharded_model import DEFAULT_PERSISTENCE_THRESHOLD
from ..zero.unit_grads import MAX_IN_FLIGHT
from . import activations as act
from .layouts import Layout
from .shapes import ModelShape

MB = 1 << 20
GIB = 1 << 30
F32 = 4
ADAM_STATE = 8  # AdamW's exp_avg and exp_avg_sq, fp32
# stage 3: block-unit buffers live at once: the unit in use and the one prefetched, its
# gradient buffer and the one before it still reduce-scattering (see _zero3)
BLOCK_SLOTS = 4


@dataclass(frozen=True)
class Job:
    """What the memory depends on besides the layout: the batch and the settings."""

    batch: int
    bucket_mb: float
    schedule: str
    sequence_parallel: bool
    dropout: float
    prefetch: int = 2  # offload=disk: units read ahead
    clip: bool = False  # gradient clipping (offload: records keep the gradient too)
    max_live_bytes: int = 0  # ZeRO-3's live budget (0: none)
    compute_bytes: int = F32  # forward and backward's dtype (2: bf16 or fp16, at zero 3)
    max_unit_bytes: int = 0  # ZeRO-3's largest unit: larger layers outside blocks tiled


COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def job_of(cfg: Any) -> Job:
    """The :class:`Job` of the trainer's settings ``cfg`` (a :class:`TrainConfig`)."""
    return Job(cfg.batch_size, cfg.bucket_mb, cfg.schedule, cfg.sequence_parallel,
               cfg.dropout, getattr(cfg, "offload_prefetch", 2), bool(cfg.max_grad_norm),
               int(getattr(cfg, "max_live_mb", 0.0) * MB),
               COMPUTE_BYTES[getattr(cfg, "precision", "fp32")],
               int(getattr(cfg, "max_unit_mb", 0.0) * MB))


@dataclass
class Memory:
    """One rank's predicted bytes: the model states, buffers and activations."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    buffers: dict[str, int] = field(default_factory=dict)
    activations: int = 0  # at the peak, beside the states and buffers
    end_of_backward: int = 0  # stage 2's bucket buffers (their peak, activations gone)
    units: list[int] = field(default_factory=list)  # stage 3: each unit's whole bytes
    experts: dict[str, int] = field(default_factory=dict)  # their params, grads, optimizer
    offloaded: int = 0  # elements whose optimizer state lives in the unit store (offload)
    step_pass: int = 0  # offload's deferred step: its records beyond backward's (no activations)

    @property
    def states(self) -> int:
        return (self.params + self.grads + self.optimizer + sum(self.buffers.values())
                + sum(self.experts.values()))

    @property
    def peak(self) -> int:
        return self.states + max(self.activations, self.end_of_backward, self.step_pass)


def _meta(numels: list[int]) -> list[nn.Parameter]:
    """Stand-ins of the sizes given (no memory), for the project's layout classes."""
    return [nn.Parameter(torch.empty(n, device="meta")) for n in numels]


def _flat(numels: list[int], world: int, bucket_mb: float, stage: int) -> ShardLayout:
    """The flat layout stages 1-2 use (stage 2's buckets capped as FlatShards caps them:
    at C_B and at a quarter of what the shards leave of the gradient)."""
    cap = int(bucket_mb * MB)
    if stage == 2 and world > 1:
        whole = sum(numels) * F32
        cap = max(1, min(cap, whole * (world - 1) // (4 * world)))
    return ShardLayout(_meta(numels), world, 0, cap, torch.float32)


def _tiles(numel: int, rows: int, max_numel: int) -> list[list[int]]:
    """A parameter's ZeRO-3 tiles (:func:`pycomm.parallel.compose.tiles.row_bounds`), one unit
    each."""
    rows = max(rows, 1)
    return [[(b - a) * (numel // rows)] for a, b in row_bounds(rows, numel // rows, max_numel)]


def _zero3_units(m: ModelShape, layout: Layout, stage: int, max_numel: int = 0
                 ) -> dict[str, list[list[int]]]:
    """Stage 3's units on one rank of ``stage``, by kind, each a list of parameter
    sizes: a block's large parameters (``blocks``); the stage's other large ones, its
    own unit (``own``); a parameter tied across pipeline stages, a unit of its own on
    each (``ties``); everything under the persistence threshold (``persistent``); and
    the units a pass gathers one after another, in forward order (``sequence``: the
    blocks, the ties and the layers of their own).
    Offloaded, nothing persists (the small parameters join their layer's unit) and a
    layer outside the blocks of ``OWN_UNIT_NUMEL`` parameters or more is a unit of its
    own (``own``, one each), as :func:`pycomm.parallel.zero.plan_units.zero3_units`
    makes them. ``max_numel`` (``max_unit_bytes``): a parameter outside the blocks
    holding more is split by rows into units of at most that many (``tiles``), as
    :mod:`pycomm.parallel.compose.apply_tiles` splits them (at tp = 1, where they run)."""
    offloaded = layout.offload != "none"
    tiling = max_numel if layout.tp == 1 else 0
    threshold = 0 if offloaded else DEFAULT_PERSISTENCE_THRESHOLD
    elsewhere = {p.key for s in range(layout.pp) if s != stage
                 for lay in m.stage_layers(layout.pp, s) for p in lay.params}
    out: dict[str, list[list[int]]] = {"own": [[]], "blocks": [], "ties": [], "tiles": [],
                                       "persistent": [[]], "sequence": []}
    seen: set[str] = set()
    for lay in m.stage_layers(layout.pp, stage):
        block: list[int] = []
        for p in lay.params:
            if p.key in seen or (p.expert and layout.ep > 1):  # beside ZeRO: expert_states
                continue
            seen.add(p.key)
            n = p.numel // layout.tp if p.tp_split else p.numel
            if p.key in elsewhere:
                out["ties"].append([n])
                out["sequence"].append(out["ties"][-1])
            elif tiling and not lay.is_block and n > tiling:
                tiles = _tiles(n, p.rows, tiling)
                out["tiles"] += tiles
                out["sequence"] += tiles
            elif n < threshold:
                out["persistent"][0].append(n)
            else:
                block.append(n)
        if lay.is_block:
            out["blocks"].append(block)
        elif offloaded and sum(block) >= OWN_UNIT_NUMEL:
            out["own"].append(block)
        else:
            out["own"][0].extend(block)
            continue
        out["sequence"].append(block)
    return {k: [u for u in v if u] for k, v in out.items()}


def _window(sizes: list[int], width: int) -> int:
    """The most ``width`` consecutive ``sizes`` add up to (all of them if fewer)."""
    if len(sizes) <= width:
        return sum(sizes)
    return max(sum(sizes[i : i + width]) for i in range(len(sizes) - width + 1))


def _zero3(mem: Memory, m: ModelShape, layout: Layout, stage: int, job: Job) -> None:
    """Stage 3's shards and pool (see the module docstring). The pool keeps, per unit
    size, the most buffers live at once: a unit gathered once a step (its own, a tie,
    the persistent one) holds its parameters and up to two gradient buffers being
    reduce-scattered (``MAX_IN_FLIGHT``: one per micro-batch's backward); block units,
    which share one size, ``BLOCK_SLOTS`` (gathered, prefetched, gradients in flight)."""
    kinds = _zero3_units(m, layout, stage, job.max_unit_bytes // F32)
    groups = [u for k in ("own", "blocks", "ties", "tiles", "persistent") for u in kinds[k]]
    numels = [n for g in groups for n in g]
    spans, index = [], 0
    for g in groups:
        spans.append(list(range(index, index + len(g))))
        index += len(g)
    sl = ShardLayout.from_groups(numels, spans, layout.dp, 0, torch.float32)
    elements = [b.shard * layout.dp for b in sl.buckets]
    mem.units = [F32 * n for n in elements]
    mem.params = F32 * sl.shard_numel
    mem.grads = F32 * sl.shard_numel
    mem.optimizer = ADAM_STATE * sl.shard_numel
    # a unit's gathered parameters are in the compute dtype, its gradient buffers in the
    # reduce dtype (fp32)
    gathered, reducing = job.compute_bytes, F32
    once = 1 + min(layout.microbatches, MAX_IN_FLIGHT)  # parameters, gradients in flight
    sizes = dict(zip(map(id, groups), elements, strict=True))
    pool = sum((gathered + (once - 1) * reducing) * sizes[id(u)]
               for k in ("own", "ties", "persistent") for u in kinds[k])
    if kinds["blocks"]:
        # the unit in use and the one prefetched, its gradient and the one reducing
        pairs = BLOCK_SLOTS // 2 if len(kinds["blocks"]) > 1 else 1  # nothing to prefetch
        pool += pairs * (gathered + reducing) * max(sizes[id(u)] for u in kinds["blocks"])
    # tiles as blocks, for each of their (at most two) sizes: the pool's free lists are
    # per size
    for size in {sizes[id(u)] for u in kinds["tiles"]}:
        pool += (2 if len(kinds["tiles"]) > 1 else 1) * (gathered + reducing) * size
    if job.max_live_bytes:
        # the budget holds prefetch back and frees what it would keep beyond it, but the
        # unit in use is gathered whatever it says: its parameters, the gradient being
        # filled and those being reduced
        largest = max(elements, default=0)
        pool = max(min(pool, job.max_live_bytes),
                   (gathered + (1 + MAX_IN_FLIGHT) * reducing) * largest)
    mem.buffers["zero3 pool"] = pool
    if gathered != F32 and layout.offload == "none":
        # the shards cast to the compute dtype, gathered from (ShardsInMemory.compute_copy)
        mem.buffers["zero3 compute-dtype shards"] = gathered * sl.shard_numel
    if layout.offload != "none":
        _offloaded_records(mem, [sizes[id(u)] // layout.dp for u in kinds["sequence"]],
                           max((b.shard for b in sl.buckets), default=0), layout, job)
        mem.offloaded = sl.shard_numel
        if layout.offload == "cpu":  # the store itself is host memory: every record, whole
            fields = F32 + ADAM_STATE + (F32 if offload_deferred(layout, job) else 0)
            mem.buffers["offload host store"] = sl.shard_numel * fields


def offload_deferred(layout: Layout, job: Job) -> bool:
    """Stage 3 offload steps after backward (its records hold the gradient too)."""
    return job.clip or layout.microbatches > 1


def _offloaded_records(mem: Memory, sequence: list[int], largest: int, layout: Layout,
                       job: Job) -> None:
    """Stage 3 offload (:mod:`pycomm.parallel.zero.offload`): no shard, master or state stays
    in memory; a unit's record is mapped only around its use, with only the fields the
    pass touches. ``sequence``: the shard elements of the units a pass takes in turn.

    In forward and backward a window of consecutive units is mapped: ``k`` read ahead,
    the unit in use, and in backward those whose reduction is in flight and one being
    written back; forward reads the fp32 master alone; backward, stepping each unit as
    it goes, the master and the optimizer state, or, deferred (clipping, micro-batches),
    the master and the gradient. The deferred step pass afterwards, with activations
    gone, maps ``k + 2`` records whole (master, state, gradient). The reduced gradient
    shards live until their unit steps (or lands in its record)."""
    deferred = offload_deferred(layout, job)
    backward_fields = F32 + (F32 if deferred else ADAM_STATE)
    window = job.prefetch + 1 + MAX_IN_FLIGHT + MAX_WRITES
    mem.buffers["offload records"] = _window(sequence, window) * backward_fields
    mem.buffers["offload gradient shards"] = (min(len(sequence), 1 + MAX_IN_FLIGHT)
                                              * largest * F32)
    if deferred:
        step = _window(sequence, job.prefetch + 1 + MAX_WRITES) * (2 * F32 + ADAM_STATE)
        beside = mem.buffers["offload records"] + mem.buffers["offload gradient shards"]
        mem.step_pass = max(0, step - beside)
    mem.params = mem.grads = mem.optimizer = 0


def states(m: ModelShape, layout: Layout, job: Job, stage: int) -> Memory:
    """Parameters, gradients, optimizer state and their buffers on one rank of ``stage``."""
    mem = Memory()
    numels = m.stage_params(layout.pp, stage, layout.tp, layout.ep)
    experts = m.stage_experts(layout.pp, stage, layout.ep)
    if experts:
        mem.experts = expert_states(experts, layout, job)
    if layout.zero == 3:
        _zero3(mem, m, layout, stage, job)
        return mem
    dense = flat_states(numels, layout.dp, job.bucket_mb, layout.zero)
    mem.params, mem.grads, mem.optimizer = dense["params"], dense["grads"], dense["optimizer"]
    mem.end_of_backward = dense["end_of_backward"]
    if layout.offload != "none" and layout.zero > 0:
        _zero_offload(mem, numels, layout, job)
    return mem


def _zero_offload(mem: Memory, numels: list[int], layout: Layout, job: Job) -> None:
    """ZeRO-Offload at stages 1-2: each bucket's optimizer state is a record in the store,
    in memory while its bucket steps (read ahead, in use, being written back)."""
    flat = _flat(numels, layout.dp, job.bucket_mb, layout.zero)
    bucket = max((b.shard for b in flat.buckets), default=0)
    records = min(len(flat.buckets), job.prefetch + 1 + MAX_WRITES)
    mem.buffers["offload records"] = records * bucket * ADAM_STATE
    if layout.offload == "cpu":  # the store itself is host memory
        mem.buffers["offload host store"] = flat.shard_numel * ADAM_STATE
    mem.optimizer, mem.offloaded = 0, flat.shard_numel


def expert_states(numels: list[int], layout: Layout, job: Job) -> dict[str, int]:
    """The experts' parameters, gradients and optimizer state on one rank (see the
    module docstring): their own ZeRO over ``edp`` (at most stage 2), whole at edp 1."""
    stage = min(layout.zero, 2) if layout.edp > 1 else 0
    out = flat_states(numels, layout.edp, job.bucket_mb, stage)
    out.pop("end_of_backward")
    return out


def flat_states(numels: list[int], world: int, bucket_mb: float, zero: int
                ) -> dict[str, int]:
    """Bytes of ``numels``' parameters, gradients and optimizer state under ZeRO stage
    ``zero`` (0-2) over ``world`` ranks, and what reducing after backward adds at its end."""
    if zero == 0:
        aligned = sum(-(-n // 16) * 16 for n in numels)  # the averaging arena's views
        return {"params": F32 * sum(numels), "grads": F32 * aligned,
                "optimizer": ADAM_STATE * sum(numels), "end_of_backward": 0}
    flat = _flat(numels, world, bucket_mb, zero)
    streams = zero == 2 and world > 1
    # Reducing after backward, the gradients arrive beside the states: stage 2 streams
    # them into every bucket's buffer; stage 1 (and 2 on one rank) leaves them in the
    # .grad tensors autograd allocates (zero_grad set them to None) until
    # reduce_gradients copies them into the arena.
    return {"params": F32 * flat.numel,
            "grads": F32 * (flat.shard_numel if streams else flat.numel),
            "optimizer": ADAM_STATE * flat.shard_numel,
            "end_of_backward": F32 * (flat.numel if streams else sum(numels))}


def _backward_grads(m: ModelShape, layout: Layout, stage: int, total: int) -> list[int]:
    """Bytes of ``total`` (the transient gradients) that exist when each of the stage's
    blocks starts its backward, last block first: those of the layers after it."""
    layers = m.stage_layers(layout.pp, stage)
    sizes = [sum(p.numel // layout.tp if p.tp_split else p.numel for p in lay.params)
             for lay in layers]
    whole = max(1, sum(sizes))
    out = []
    for i in reversed(range(len(layers))):
        if layers[i].is_block:
            out.append(total * sum(sizes[i + 1 :]) // whole)
    return out


def _loss_chunk(m: ModelShape, layout: Layout, job: Job) -> int:
    """A tiled head's largest vocabulary chunk, the loss's (0: the head stays whole)."""
    most = job.max_unit_bytes // F32
    if layout.zero != 3 or layout.tp != 1 or not most or m.vocab * m.hidden <= most:
        return 0
    return max(b - a for a, b in row_bounds(m.vocab, m.hidden, most))


def activation_peak(m: ModelShape, layout: Layout, job: Job, stage: int,
                    transient_grads: int = 0) -> tuple[int, int, int]:
    """(Bytes of activations at the peak, the checkpoint arena's, the pipeline's
    messages') on one rank of ``stage``: the largest of the head's backward (last stage)
    and each block's, with the transient gradients of the layers already through
    backward (stages 1-2) beside them."""
    rows = job.batch // (layout.dp * layout.microbatches)
    a = act.ActShape(rows, m.seq, layout.tp, job.sequence_parallel, job.dropout,
                     job.compute_bytes, _loss_chunk(m, layout, job))
    flying = act.in_flight(job.schedule, layout.pp, stage, layout.microbatches)
    grads_before = _backward_grads(m, layout, stage, transient_grads)
    blocks = len(grads_before)
    per_mb = act.embed_saved(a) if stage == 0 else 0
    messages = (act.pipeline_messages(m, a, layout.pp, stage, layout.microbatches)
                if layout.pp > 1 else 0)
    working, saved_block = act.block_working(m, a), act.block_saved(m, a)
    arena = 0
    if layout.recompute:
        arena = flying * blocks * act.checkpoint_kept(m, a, layout.partition_activations)
        saved = arena + flying * per_mb
        phases = [saved + saved_block + working + g for g in grads_before]
    else:
        saved = flying * (blocks * saved_block + per_mb)
        # the j-th block through backward has freed the j before it (of one micro-batch)
        phases = [saved - j * saved_block + working + g for j, g in enumerate(grads_before)]
    if layout.microbatches > 1 and transient_grads:
        # a later micro-batch's backward: every gradient of the stage exists already,
        # and at most m - 1 micro-batches wait for theirs
        later = min(flying, layout.microbatches - 1)
        held = (saved + saved_block if layout.recompute
                else later * (blocks * saved_block + per_mb))
        phases.append(held + working + transient_grads)
    if stage == layout.pp - 1:
        phases.append(saved + act.head_saved(m, a) + act.head_working(m, a))
    return max(phases, default=saved), arena, messages


def predict(m: ModelShape, layout: Layout, job: Job) -> list[Memory]:
    """Each pipeline stage's per-rank memory (every rank of a stage holds the same)."""
    out = []
    for stage in range(layout.pp):
        mem = states(m, layout, job, stage)
        peak, arena, messages = activation_peak(m, layout, job, stage,
                                                mem.end_of_backward)
        if arena:
            mem.buffers["checkpoint arena"] = arena
        if messages:
            mem.buffers["pipeline messages"] = messages
        mem.activations = peak - arena
        out.append(mem)
    return out
