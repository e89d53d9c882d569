"""``bench.plan_accuracy --report``: the planner's predictions against the measured
layouts (NAME.jsonl), as a markdown error table."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from pycomm.parallel.job.config import parse
from pycomm.parallel.planner.calibrate import Calibration
from pycomm.parallel.planner.collective_times import CommModel
from pycomm.parallel.planner.layouts import Layout
from pycomm.parallel.planner.planner import GIB, Row, evaluate, job_of
from pycomm.parallel.planner.shapes import model_shape
from pycomm.parallel.planner.timing import predict_time

MIB = 1 << 20


def _key(layout: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(layout[k] for k in ("dp", "tp", "pp", "zero", "recompute",
                                     "partition_activations"))


def _lkey(x: Layout) -> tuple[Any, ...]:
    return (x.dp, x.tp, x.pp, x.zero, x.recompute, x.partition_activations)


def _pct(pred: float, meas: float) -> float:
    return 100.0 * (pred - meas) / meas


def load(path: Path) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    out = {}
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        out[_key(doc["layout"])] = doc["ranks"]
    return out


def load_times(path: Path, world: int) -> dict[tuple[Any, ...], tuple[float, float]]:
    """Each layout's fastest step (``--time-only``: the step least disturbed by other
    load; every rank times the same step between barriers, rank 0's is taken) and the
    load beside the job then: the 1-minute load average less the job's own ranks."""
    out: dict[tuple[Any, ...], tuple[float, float]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            rank0 = doc["ranks"][0]
            if "step_times" in rank0:
                other = max(0.0, rank0["loadavg"][0] - world)
                out[_key(doc["layout"])] = (min(rank0["step_times"]), other)
    return out


def compare(row: Row, ranks: list[dict[str, Any]], fastest: float | None) -> dict[str, Any]:
    """Per rank: measured peak against its stage's prediction; the step time (the
    fastest of the time-only run where there is one, else the memory run's median)."""
    errs, meas, pred = [], [], []
    for r in ranks:
        stage = r["coords"][0]
        p = row.memory[stage].peak
        errs.append(_pct(p, r["peak"]))
        meas.append(r["peak"])
        pred.append(p)
    worst = max(range(len(errs)), key=lambda i: abs(errs[i]))
    step = fastest if fastest is not None else max(r["step_s"] for r in ranks)
    return {"mem_err": errs[worst], "mem_meas": meas[worst], "mem_pred": pred[worst],
            "max_meas": max(meas), "max_pred": max(pred),
            "rss": max(r["rss_over_start"] for r in ranks),
            "step_meas": step, "step_pred": row.time.total,
            "step_err": _pct(row.time.total, step)}


def report(args: argparse.Namespace) -> str:
    cfg = parse(args.rest)
    measured = load(Path(args.out + ".jsonl"))
    times = load_times(Path(args.out + ".time.jsonl"), args.world)
    shape = model_shape(cfg)
    rows, _ = evaluate(cfg, args.world, 1e9, offloads=("none",), shape=shape)
    cal, comm = Calibration("", cfg.threads), CommModel()
    lines = [f"# Planner accuracy: {cfg.model} n_layer={cfg.n_layer} n_embd={cfg.n_embd} "
             f"n_head={cfg.n_head} block_size={cfg.block_size} batch={cfg.batch_size}, "
             f"{args.world} ranks", "",
             "| layout | measured peak MiB (worst rank) | predicted MiB | error % | "
             "worst rank's peak RSS rise MiB | measured step s | predicted s | error % |",
             "|---|---|---|---|---|---|---|---|"]
    results, failed = [], []
    for row in rows:
        ranks = measured.get(_lkey(row.layout))
        if ranks is None:
            continue
        if any("error" in r for r in ranks):
            failed.append((row.layout, next(r["error"] for r in ranks if "error" in r)))
            continue
        timed = times.get(_lkey(row.layout))
        as_planned = row.time.total  # what --plan auto ranks by (no other load)
        if timed is not None:  # predicted with the load that was beside the job then
            row.time = predict_time(shape, row.layout, job_of(cfg), row.memory, cal, comm,
                                    cfg.threads, timed[1])
        c = compare(row, ranks, timed[0] if timed else None)
        c["as_planned"] = as_planned
        results.append((row, c))
    for row, c in sorted(results, key=lambda x: str(x[0].layout)):
        lines.append(f"| {row.layout} | {c['mem_meas'] / MIB:.2f} | {c['mem_pred'] / MIB:.2f} "
                     f"| {c['mem_err']:+.1f} | {c['rss'] / MIB:.1f} | {c['step_meas']:.3f} | "
                     f"{c['step_pred']:.3f} | {c['step_err']:+.0f} |")
    lines += ["", *summary(results), *noise(results), *auto_choice(results)]
    for layout, err in failed:
        lines.append(f"- failed to run: {layout}: {err.strip().splitlines()[-1]}")
    return "\n".join(lines) + "\n"


def summary(results: list[tuple[Row, dict[str, Any]]]) -> list[str]:
    mem = [abs(c["mem_err"]) for _, c in results]
    step = [abs(c["step_err"]) for _, c in results]
    if not mem:
        return ["no layout measured"]
    within = sum(e <= 10 for e in mem)
    return [f"Memory (every rank, against its stage's prediction): {within}/{len(mem)} "
            f"layouts within 10% at their worst rank; |error| median "
            f"{statistics.median(mem):.1f}%, largest {max(mem):.1f}%.",
            f"Step time: |error| median {statistics.median(step):.0f}%, largest "
            f"{max(step):.0f}%.", ""]


def noise(results: list[tuple[Row, dict[str, Any]]]) -> list[str]:
    """The measurement's own spread: at tp = 1, recompute with and without P_a do the
    same work (P_a over a group of one), so their measured times differ by noise."""
    by = {_lkey(r.layout): c["step_meas"] for r, c in results}
    diffs = [abs(t - by[(*k[:5], True)]) / min(t, by[(*k[:5], True)]) * 100
             for k, t in by.items() if k[1] == 1 and k[4] and not k[5] and (*k[:5], True) in by]
    if not diffs:
        return []
    return [f"Noise floor: at tp = 1, recompute and recompute + P_a (the same work) measured "
            f"{statistics.median(diffs):.0f}% apart (median; largest {max(diffs):.0f}%, "
            f"{len(diffs)} pairs).", ""]


def auto_choice(results: list[tuple[Row, dict[str, Any]]]) -> list[str]:
    """``--plan auto``'s pick against the fastest layout measured, with no memory
    limit and with one at the median measured peak (where about half fit)."""
    out = []
    peaks = sorted(c["max_meas"] for _, c in results)
    for cap in (None, peaks[len(peaks) // 2]):
        fit = [(r, c) for r, c in results if cap is None or c["max_pred"] <= cap]
        really = [(r, c) for r, c in results if cap is None or c["max_meas"] <= cap]
        if not fit or not really:
            continue
        pick = min(fit, key=lambda x: x[1]["as_planned"])
        best = min(really, key=lambda x: x[1]["step_meas"])
        order = sorted(really, key=lambda x: x[1]["step_meas"])
        place = next((i for i, x in enumerate(order, 1) if x[0] is pick[0]), None)
        limit = "no memory limit" if cap is None else f"memory limit {cap / GIB:.4f} GiB"
        fits = pick[1]["max_meas"] <= cap if cap is not None else True
        out.append(f"- {limit}: `--plan auto` picks **{pick[0].layout}** (predicted "
                   f"{pick[1]['as_planned']:.3f} s on an idle machine, measured "
                   f"{pick[1]['step_meas']:.3f} s, "
                   f"measured peak {'within' if fits else 'OVER'} the limit); the fastest "
                   f"measured is **{best[0].layout}** ({best[1]['step_meas']:.3f} s); the pick "
                   f"is #{place} of {len(really)} measured that fit")
    return out
