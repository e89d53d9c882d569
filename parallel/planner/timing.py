"""Predicted step time of a layout: measured compute (:mod:`pycomm.parallel.planner.calibrate`),
collectives at the benchmark's measured times (:mod:`pycomm.parallel.planner.collective_times`), the
pipeline's bubble, and for offload the disk's measured bandwidth.

- compute: per micro-batch, each block's forward + backward (plus one more forward
  under recompute) at the rank's local shapes, the head's on the last stage; ranks
  that outnumber the CPUs share them (``(ranks * threads + other load) / cpus``, at
  least 1; the other load: runnable processes beside the job, as the load average
  counts them);
- tensor parallelism: per block and micro-batch, Megatron's two all-reduces in forward
  and two in backward of ``b s h`` activations (two more with recompute), over ``t``;
- pipeline: ``m`` micro-batches through ``p`` stages take ``m + p - 1`` slots of the
  slowest stage's time (the bubble, ``(p - 1)/m`` of the work: Huang et al. 2019,
  Narayanan et al. 2021); where ranks share CPUs, a slot's time is shared by the
  stages busy in it only (the fill and the drain run on fewer), plus a send of the
  activations and one of their gradient per slot;
- data parallelism, after backward (the composed engine reduces then): stage 0-1 an
  all-reduce per bucket, stage 1-2 an all-gather of the parameters after the step,
  stage 2 a reduce-scatter per bucket; stage 3 per micro-batch an all-gather of every
  unit in forward and again in backward and a reduce-scatter of its gradient;
- the optimizer: AdamW's measured time per element over the elements this rank steps;
- expert parallelism: per block and micro-batch, the dispatch and the combine in forward
  and their gradients in backward, four all-to-alls of the ``b s k h`` routed rows over
  ``ep`` (timed as an all-gather of the same bytes: both move ``(N-1)/N`` of them per
  rank); once a step the experts' gradients reduced over ``edp`` (as the dense ones over
  ``dp``);
- offload=disk: at stage 3 each unit's master and state read and written once a step
  (with clipping, the gradient written in backward and a step pass reading every
  record), at stages 1-2 (ZeRO-Offload) the optimizer state read and written by the
  step, at the measured bandwidth, hidden behind compute with a prefetch depth k >= 1;
- waiting for peers: each blocking collective between stretches of compute costs what
  :mod:`pycomm.parallel.planner.sync_probe` measured on this machine for the job's ranks at that
  stretch's length (a rank reaching it first waits for peers the scheduler has not run;
  where ranks outnumber the CPUs, a time slice): per micro-batch and block the tensor-
  parallel all-reduces, per micro-batch the pipeline's receives, ZeRO-3's gathers and
  reduce-scatter per unit, and once a step the data-parallel reduction after backward.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from .calibrate import (
    Calibration,
    adam_seconds_per_element,
    block_times,
    disk_bandwidth,
    head_times,
)
from .collective_times import CommModel
from .layouts import Layout
from .memory import Job, Memory, offload_deferred
from .shapes import ModelShape
from .sync_probe import sync_waits

F32 = 4
# compute between collectives at which the wait for peers is measured (single-core s)
SYNC_STRETCHES = (0.0005, 0.002, 0.008, 0.032)
PROBE_RANKS_PER_CPU = 4  # the probe's ranks at most; a larger world takes that reading


@dataclass
class StepTime:
    """Seconds of one step, by what takes them."""

    compute: float = 0.0
    bubble: float = 0.0
    tensor_comm: float = 0.0
    pipeline_comm: float = 0.0
    data_comm: float = 0.0
    expert_comm: float = 0.0
    optimizer: float = 0.0
    offload_io: float = 0.0
    sync_wait: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tensor_comm + self.pipeline_comm
                + self.data_comm + self.expert_comm + self.optimizer + self.offload_io
                + self.sync_wait)


def _cpus() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cpus or 1)


def sharing(world: int, threads: int, other_load: float = 0.0) -> float:
    """How many runnable threads share each CPU (at least 1): the ranks' and
    ``other_load`` others'."""
    return max(1.0, (world * threads + max(0.0, other_load)) / _cpus())


def _busy(slot: int, pp: int, microbatches: int) -> int:
    """Stages with a micro-batch in ``slot`` of the pipeline's ``m + p - 1``: stage s
    works on micro-batch ``slot - s`` when that is one of the ``m``."""
    return sum(0 <= slot - s < microbatches for s in range(pp))


def _block_times(m: ModelShape, layout: Layout, rows: int,
                 cal: Calibration) -> tuple[float, float]:
    """(forward, forward + backward) seconds of one block on one rank."""
    gated = m.kind == "llama"
    fwd, both = cal.get(f"block|{m.hidden}|{m.heads}|{m.ffn}|{rows}|{m.seq}|{layout.tp}|"
                        f"{gated}", lambda: block_times(m.hidden, m.heads, m.ffn, rows,
                                                        m.seq, layout.tp, gated))
    return fwd, both


def _stage_compute(m: ModelShape, layout: Layout, rows: int, stage: int,
                   cal: Calibration) -> float:
    """Seconds of one micro-batch's forward and backward on one rank of ``stage``."""
    blocks = sum(x.is_block for x in m.stage_layers(layout.pp, stage))
    fwd, both = _block_times(m, layout, rows, cal)
    seconds = blocks * (both + (fwd if layout.recompute else 0.0))
    if stage == layout.pp - 1:
        seconds += cal.get(f"head|{m.hidden}|{m.vocab}|{rows}|{m.seq}|{layout.tp}",
                           lambda: head_times(m.hidden, m.vocab, rows, m.seq, layout.tp))[1]
    return seconds


def _data_comm(layout: Layout, mem: Memory, unit_bytes: list[int], comm: CommModel,
               bucket_bytes: float) -> float:
    """Seconds of the data-parallel side's collectives in one step (one rank)."""
    n = layout.dp
    if n == 1:
        return 0.0
    whole = mem.params if layout.zero in (1, 2) else mem.grads
    buckets = max(1, int(-(-whole // bucket_bytes)))
    per = whole / buckets
    if layout.zero in (0, 1):
        seconds = buckets * comm.all_reduce(per, n)
        return seconds + (comm.all_gather(whole, n) if layout.zero == 1 else 0.0)
    if layout.zero == 2:
        return buckets * comm.reduce_scatter(per, n) + comm.all_gather(whole, n)
    per_mb = sum(2 * comm.all_gather(u, n) + comm.reduce_scatter(u, n) for u in unit_bytes)
    return layout.microbatches * per_mb


def _expert_comm(m: ModelShape, layout: Layout, mem: Memory, rows: int, comm: CommModel,
                 bucket_bytes: float) -> float:
    """Seconds of expert parallelism's collectives in one step (one rank)."""
    if layout.ep == 1 or not mem.experts:
        return 0.0
    routed = F32 * rows * m.seq * m.top_k * m.hidden
    blocks = m.n_layer / layout.pp
    seconds = layout.microbatches * blocks * 4 * comm.all_gather(routed, layout.ep)
    n, whole = layout.edp, mem.experts["params"]
    if n > 1:
        buckets = max(1, int(-(-whole // bucket_bytes)))
        zero = min(layout.zero, 2)
        per = whole / buckets
        if zero == 0:
            seconds += buckets * comm.all_reduce(per, n)
        else:
            reduce = comm.all_reduce if zero == 1 else comm.reduce_scatter
            seconds += buckets * reduce(per, n) + comm.all_gather(whole, n)
    return seconds


def _waits(m: ModelShape, layout: Layout, rows: int, stage_s: float,
           cal: Calibration) -> list[tuple[int, float]]:
    """(how many, compute seconds before each) of a rank's blocking collectives in a
    step, on one CPU (the probe's stretches are single-core times too)."""
    fwd, both = _block_times(m, layout, rows, cal)
    mb, blocks = layout.microbatches, m.n_layer / layout.pp
    waits: list[tuple[int, float]] = []
    if layout.tp > 1:  # two all-reduces per block in forward, two in backward
        waits += [(round(2 * mb * blocks), fwd / 2), (round(2 * mb * blocks), (both - fwd) / 2)]
        if layout.recompute:
            waits.append((round(2 * mb * blocks), fwd / 2))
    if layout.pp > 1:  # a receive before each micro-batch's forward and its backward
        waits.append((2 * mb, stage_s / 2))
    if layout.dp > 1 and layout.zero == 3:  # per unit: gather, gather again, reduce-scatter
        waits.append((round(3 * mb * blocks), both / 3))
    elif layout.dp > 1:  # the reduction after backward
        waits.append((1, mb * stage_s))
    return waits


def sync_wait(world: int, threads: int, compute_s: float, cal: Calibration) -> float:
    """The measured wait per blocking collective of ``world`` ranks after ``compute_s``
    of compute: interpolated between the probe's stretches, the nearest outside them."""
    probed = min(world, PROBE_RANKS_PER_CPU * _cpus())  # a planner run spawns no more
    waits = cal.get(f"sync|{probed}|{threads}",
                    lambda: tuple(sync_waits(probed, SYNC_STRETCHES, threads)))
    points = list(zip(SYNC_STRETCHES, waits, strict=True))
    if compute_s <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if compute_s <= x1:
            return y0 + (y1 - y0) * (compute_s - x0) / (x1 - x0)
    return points[-1][1]


def predict_time(m: ModelShape, layout: Layout, job: Job, mems: list[Memory],
                 cal: Calibration, comm: CommModel, threads: int = 1,
                 other_load: float = 0.0) -> StepTime:
    """The step time of ``layout`` (the slowest stage's ranks)."""
    t = StepTime()
    mb = layout.microbatches
    rows = max(1, job.batch // (layout.dp * mb))
    share = sharing(layout.dp * layout.tp * layout.pp, threads, other_load)
    slowest = max(_stage_compute(m, layout, rows, s, cal) for s in range(layout.pp))
    # m + p - 1 slots of the slowest stage; in slot k the stages holding a micro-batch
    # share the CPUs (a stage waiting in the fill or the drain leaves its CPU to them)
    ranks_per_stage = layout.dp * layout.tp
    slots = [slowest * sharing(_busy(k, layout.pp, mb) * ranks_per_stage, threads, other_load)
             for k in range(mb + layout.pp - 1)]
    t.compute = mb * slowest * share
    t.bubble = max(0.0, sum(slots) - t.compute)
    act_bytes = F32 * rows * m.seq * m.hidden
    if layout.tp > 1:
        per_block = (6 if layout.recompute else 4) * comm.all_reduce(act_bytes, layout.tp)
        t.tensor_comm = mb * m.n_layer / layout.pp * per_block
    if layout.pp > 1:
        t.pipeline_comm = (mb + layout.pp - 1) * 2 * comm.send(act_bytes)
    worst = max(range(layout.pp), key=lambda s: mems[s].params + mems[s].grads)
    t.data_comm = _data_comm(layout, mems[worst], mems[worst].units, comm,
                             job.bucket_mb * (1 << 20))
    t.expert_comm = _expert_comm(m, layout, mems[worst], rows, comm,
                                 job.bucket_mb * (1 << 20))
    stepped = ((mems[worst].optimizer + mems[worst].experts.get("optimizer", 0)) / 8
               + mems[worst].offloaded)
    adam = cal.get("adamw-fused", lambda: (adam_seconds_per_element(),))[0]
    t.optimizer = stepped * adam * share
    world = layout.dp * layout.tp * layout.pp
    if world > 1:
        t.sync_wait = sum(n * sync_wait(world, threads, c, cal)
                          for n, c in _waits(m, layout, rows, slowest, cal))
    if layout.offload == "disk":
        read, write = cal.get(f"disk|{job_offload_dir()}",
                              lambda: disk_bandwidth(job_offload_dir()))
        # fields of fp32 per offloaded element. ZeRO-Offload (stages 1-2): the step reads
        # and writes the two moments. Stage 3: forward reads the master; backward reads it
        # again and the state, writes master and state. Deferred (clipping,
        # micro-batches): each backward reads the master (and, after the first, the
        # gradient summed so far) and writes the gradient, then the step pass reads all
        # four and writes master and moments
        mb = layout.microbatches
        if layout.zero < 3:
            reads, writes = 2, 2
        elif offload_deferred(layout, job):
            reads, writes = 2 * mb + (mb - 1) + 4, mb + 3
        else:
            reads, writes = 4, 3
        io = mems[worst].offloaded * F32 * (reads / read + writes / write)
        # read ahead, it hides behind what runs meanwhile: stage 3's compute; at stages
        # 1-2 the step runs after backward, so only the other buckets' Adam
        beside = t.compute if layout.zero == 3 else t.optimizer
        t.offload_io = io if job.prefetch == 0 else max(0.0, io - beside)
    return t


def job_offload_dir() -> str:
    """Where offload files would go (the trainer's --offload-dir, else the temp dir)."""
    return os.environ.get("PYCOMM_PLAN_OFFLOAD_DIR", "")
