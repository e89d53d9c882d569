"""``python -m bench.meta_init``: what building a ZeRO-3 job costs each rank, with the
model built whole on every rank against built on the meta device.

A GPT of ~57M parameters (fp32 training state, 16 bytes a parameter with Adam: ~0.9 GB,
four times one rank's share at dp 4) goes through ``parallelize(..., zero=3)`` on 4
fresh ranks, once built whole on every rank (``--init full``), once on the meta device
(each rank materializes one unit at a time and keeps its shard). Printed per rank: the
most bytes in use while building (malloc's and pycomm's shared memory, read after every
aten op: bench/_memory_probe.py) over those at its start, and what the first training
step then adds at its peak. (RSS is printed beside: glibc keeps freed heap pages, so it
shows what was ever touched.)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench._dcp_runs import PeakRSS
from bench._memory_probe import PeakSampler
from bench._provenance import write_report

WIDTH, LAYERS, HEADS, SEQ = 768, 8, 12, 128


def build_and_step(init: str) -> dict[str, Any]:
    from pycomm.parallel.compose.parallelize import ParallelConfig, parallelize
    from pycomm.parallel.mesh import ParallelMesh
    from pycomm.parallel.models import GPT, GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=LAYERS, n_head=HEADS,
                    n_embd=WIDTH, tie_embeddings=True)
    mesh = ParallelMesh(dp=4)
    with PeakRSS() as rss, PeakSampler() as build:
        torch.manual_seed(0)
        with torch.device("meta" if init == "meta" else "cpu"):
            model = GPT(cfg)
        params = sum(p.numel() for p in model.parameters())
        engine = parallelize(model, mesh, ParallelConfig(zero=3))
        del model
    x = torch.randint(0, 256, (4, SEQ))
    with PeakSampler() as step:
        loss = engine.train_step(x, x).loss
    mesh.destroy()
    return {"params": params, "build_peak": build.peak - build.start,
            "build_after": build.after - build.start, "build_rss_added": rss.added,
            "step_peak": step.peak - step.start, "loss": loss}


def main(argv: list[str] | None = None) -> None:
    from pycomm.testing import RankPool

    parser = argparse.ArgumentParser(prog="python -m bench.meta_init")
    parser.add_argument("--out", help="JSON of the figures")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {}
    for init in ("full", "meta"):
        with RankPool(4, backend="pycomm", pg_timeout_s=600) as pool:  # fresh processes
            report[init] = pool.run(build_and_step, init, timeout_s=1200)
    params = report["full"][0]["params"]
    report["state_bytes"] = 16 * params
    report["share_bytes"] = 16 * params // 4
    mb = 1 << 20
    for init in ("full", "meta"):
        runs = report[init]

        def mib(key: str, runs: list[dict[str, Any]] = runs) -> list[int]:
            return [round(r[key] / mb) for r in runs]

        print(f"{init}: building, peak in use per rank {mib('build_peak')} MiB (held after "
              f"{mib('build_after')}; RSS added {mib('build_rss_added')}); first step's "
              f"peak {mib('step_peak')} MiB; loss {runs[0]['loss']:.4f}")
    print(f"fp32 training state {report['state_bytes'] / mb:.0f} MiB, one rank's share "
          f"{report['share_bytes'] / mb:.0f} MiB, parameters {params / 1e6:.1f}M")
    write_report(report, args.out)


if __name__ == "__main__":
    main()
