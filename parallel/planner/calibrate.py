"""Compute measured once on this machine and cached: one transformer block's forward
and forward + backward at a layout's local shapes (its rows, its 1/t of the heads and of
the MLP), the head's, AdamW's step per element, and the disk's read and write bandwidth
(for offload). Kept in ``~/.cache/pycomm/plan_calibration.json`` (or ``--calibration``),
keyed by what was measured and on what (torch version, threads, CPUs)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CACHE_NAME = Path(".cache") / "pycomm" / "plan_calibration.json"  # under the home folder


class LocalBlock(nn.Module):
    """What one tensor-parallel rank computes of a block: norms on the whole width, its
    ``heads`` heads and its ``ffn`` MLP columns (GPT: GELU; Llama: gated SiLU)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, ffn: int, gated: bool):
        super().__init__()
        self.heads, self.gated = heads, gated
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, hidden)
        self.fc = nn.Linear(hidden, (2 if gated else 1) * ffn)
        self.out = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        h = self.fc(self.ln_2(x))
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return x + self.out(h)


def _best_s(fn: Callable[[], object], repeats: int = 7) -> float:
    """The fastest of ``repeats`` calls after a warm-up (first-call allocations and
    dispatch caches): the machine's speed, the least disturbed by other load."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _fwd_bwd(module: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    def forward() -> None:
        with torch.no_grad():
            module(x)

    def both() -> None:
        module(x.requires_grad_()).sum().backward()

    return _best_s(forward), _best_s(both)


def block_times(hidden: int, heads: int, ffn: int, rows: int, seq: int, tp: int,
                gated: bool) -> tuple[float, float]:
    """(forward, forward + backward) seconds of one TP rank's part of a block."""
    torch.manual_seed(0)
    block = LocalBlock(hidden, max(1, heads // tp), hidden // heads, max(1, ffn // tp), gated)
    return _fwd_bwd(block, torch.randn(rows, seq, hidden))


def head_times(hidden: int, vocab: int, rows: int, seq: int, tp: int) -> tuple[float, float]:
    """(forward, forward + backward) seconds of the final norm, LM head and loss."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, max(1, vocab // tp)))
    targets = torch.randint(0, max(1, vocab // tp), (rows * seq,))

    class Loss(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = head(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)

    return _fwd_bwd(Loss(), torch.randn(rows, seq, hidden))


def adam_seconds_per_element(numel: int = 1 << 20) -> float:
    """AdamW's step (the trainer's: fused, betas 0.9, 0.95, decay) per fp32 element."""
    p = nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return _best_s(opt.step) / numel


def disk_bandwidth(folder: str = "", nbytes: int = 64 << 20) -> tuple[float, float]:
    """(read, write) bytes per second of a file in ``folder``: written and fsync'ed,
    dropped from the page cache (posix_fadvise DONTNEED), read back."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    with tempfile.NamedTemporaryFile(dir=folder or None) as f:
        start = time.perf_counter()
        os.write(f.fileno(), data)
        os.fsync(f.fileno())
        write = nbytes / (time.perf_counter() - start)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        os.pread(f.fileno(), nbytes, 0)
        read = nbytes / (time.perf_counter() - start)
    return read, write


class Calibration:
    """Measured values by key, measured on first use and kept in a JSON file."""

    def __init__(self, path: str | Path = "", threads: int = 1):
        self.path = Path(path) if path else Path.home() / CACHE_NAME
        self.threads = threads
        self.machine = f"torch{torch.__version__}-cpus{os.cpu_count()}-threads{threads}"
        self.values: dict[str, list[float]] = {}
        if self.path.exists():
            self.values = json.loads(self.path.read_text())
        self.measured = 0  # new measurements this run

    def get(self, what: str, measure: Callable[[], tuple[float, ...]]) -> list[float]:
        key = f"{self.machine}|{what}"
        if key not in self.values:
            before = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                self.values[key] = list(measure())
            finally:
                torch.set_num_threads(before)
            self.measured += 1
            self._save()
        return self.values[key]

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.values, indent=1, sort_keys=True))
        tmp.replace(self.path)
