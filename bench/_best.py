"""Every backend at its best: per job and size, the fastest of each backend's settings.

A job's runs (bench._jobs) label each column by what made it: ``gloo-1t`` (a gloo
variant, bench._gloo), ``mpi-nocma`` (Open MPI with single copy off), ``...@unpinned``
(the run with ``--bind none``), ``pycomm-api+stripes4`` (a striped group,
bench._stripes). A *family* is a backend whatever its settings: ``gloo``
takes the best of gloo and its variants pinned and unpinned, ``mpi`` of Open MPI with
and without CMA, pinned and unpinned; every pycomm entry (``pycomm``, ``pycomm-api``,
...) is its own family, pinned or unpinned, as is the A/A column (``pycomm#2``).

Per job (both settings met the same machine within seconds) and size, a family's best
time and the label that won; the *best peer* is the fastest non-pycomm family. Ratios
are taken per job and then summarised over the jobs as [median, min, max, n].
"""

from __future__ import annotations

import statistics

from bench import _limit, _stripes
from bench._timing import busbw_gbs

PEERS = ("gloo", "mpi", "deepspeed")
NOT_COMPARED = ("torch-floor",)  # no communication: a floor, not a peer


def family(label: str) -> str:
    """The backend a column measures, whatever its settings (module docstring)."""
    base = _stripes.split(label.split("@")[0])[0]  # pycomm-api+stripes4: pycomm-api
    if "#" in base:
        return base
    for peer in PEERS:
        if base == peer or base.startswith(peer + "-"):
            return peer
    return base


def is_peer(fam: str) -> bool:
    return fam in PEERS


def best_of_job(docs: list[dict]) -> dict[tuple[str, str, int], tuple[float, str]]:
    """{(op, family, bytes): (best time in µs, the label that won)} over a job's runs."""
    best: dict[tuple[str, str, int], tuple[float, str]] = {}
    for doc in docs:
        for r in doc["results"]:
            if family(r["backend"]) in NOT_COMPARED or not _stripes.counts_at(r["backend"],
                                                                              r["bytes"]):
                continue
            key = (r["op"], family(r["backend"]), r["bytes"])
            if key not in best or r["time_us"] < best[key][0]:
                best[key] = (r["time_us"], r["backend"])
    return best


def best_peer(best: dict, op: str, nbytes: int) -> tuple[float, str] | None:
    """The fastest peer family at this op and size in one job: (µs, label)."""
    peers = [v for (o, f, n), v in best.items() if o == op and n == nbytes and is_peer(f)]
    return min(peers) if peers else None


def over_floor(docs: list[dict], fam: str) -> dict[tuple[str, int], float]:
    """{(op, bytes): µs} of ``fam`` over torch's dispatch floor (the torch-floor column)
    inside each run of a job, the least over its runs (pinned, unpinned): what the
    backend adds to torch's own cost per dist.all_reduce."""
    out: dict[tuple[str, int], float] = {}
    for doc in docs:
        rows = {(r["op"], family(r["backend"]), r["bytes"]): r["time_us"]
                for r in doc["results"]}
        for (op, f, n), t in rows.items():
            floor = rows.get((op, "torch-floor", n))
            if f == fam and floor is not None:
                out[(op, n)] = min(out.get((op, n), float("inf")), t - floor)
    return out


def _is_own(fam: str) -> bool:
    """A pycomm family: not a peer, the A/A column or the floor."""
    return not is_peer(fam) and "#" not in fam and fam not in NOT_COMPARED


def reads_in_place(fam: str) -> bool:
    """A family whose buffers the peers read in place (arena tensors): its limit is the
    unstaged one (bench._limit, ``staged=False``)."""
    return fam == "pycomm-registered"


def _own_families(docs: list[dict]) -> list[str]:
    """The pycomm families a job measured."""
    return sorted({f for doc in docs for r in doc["results"] if _is_own(f := family(r["backend"]))})


def _of_family(by_family: dict[str, list[float]], fam: str) -> dict[str, list[float]]:
    """{"op|bytes": v} of one family's entries of {"op|family|bytes": v}."""
    out = {}
    for key, v in by_family.items():
        op, f, n = key.split("|")
        if f == fam:
            out[f"{op}|{n}"] = v
    return out


def _spread(values: list[float]) -> list[float]:
    return [statistics.median(values), min(values), max(values), len(values)]


def _job_limit(docs: list[dict], staged: bool = True) -> dict[tuple[str, int], float]:
    """The job's limit busbw per (op, bytes), recomputed by today's model (bench._limit)
    from the rates each of its runs measured, the best of them: every run of a job
    measures the machine again, and the limit is what it sustained at best. ``staged``
    False: the limit of buffers read in place."""
    cases = sorted({(r["op"], r["bytes"]) for r in docs[0]["results"]})
    best: dict[tuple[str, int], float] = {}
    for doc in docs:
        limit = doc.get("limit")
        if not limit or "local_gbs" not in limit:
            continue
        for key, v in _limit.limits_of_run(limit, cases, doc["meta"]["nproc"], staged).items():
            best[key] = max(best.get(key, 0.0), v)
    return best


def same_run_fractions(docs: list[dict], first: str) -> dict[tuple[str, int], list[float]]:
    """{(op, bytes): [busbw / limit]} of family ``first`` in every run of a job against the limit
    that same run measured. This VM's DRAM rate halves and doubles from one run to the
    next, so the job's fraction (its best time over its best limit) may pair a time from
    one state with a limit from another; this pairs each time with its own state, every
    run counted (no pick of the best)."""
    out: dict[tuple[str, int], list[float]] = {}
    for doc in docs:
        limit = doc.get("limit")
        if not limit or "local_gbs" not in limit:
            continue
        world = doc["meta"]["nproc"]
        mine = {(r["op"], r["bytes"]): r["time_us"] for r in doc["results"]
                if family(r["backend"]) == first}
        limits = _limit.limits_of_run(limit, sorted(mine), world, not reads_in_place(first))
        for (op, n), t in mine.items():
            out.setdefault((op, n), []).append(busbw_gbs(op, n, t, world) / limits[(op, n)])
    return out


def summarize(jobs: list[list[dict]], first: str) -> dict:
    """Over the jobs: each family's best time, who won it, every pycomm family's ratio to
    the best peer, the A/A ratio (``first#2`` over ``first``) and pycomm's fraction of the
    limit busbw (busbw of its best over the job's limit, and run by run): the first
    family's under ``limit_fraction``, every pycomm family's (``pycomm-registered``'s
    arena tensors, say) under ``limit_fraction_by_family``."""
    fam_times: dict[str, list[float]] = {}
    won: dict[str, dict[str, int]] = {}
    vs_peer: dict[str, list[float]] = {}
    peer_won: dict[str, dict[str, int]] = {}
    aa: dict[str, list[float]] = {}
    floor: dict[str, list[float]] = {}
    limit_busbw: dict[str, list[float]] = {}
    in_place_busbw: dict[str, list[float]] = {}
    by_family: dict[str, list[float]] = {}  # "op|family|bytes"
    by_family_same_run: dict[str, list[float]] = {}
    for docs in jobs:
        own = _own_families(docs)
        for fam in own:
            for (op, n), runs in same_run_fractions(docs, fam).items():
                by_family_same_run.setdefault(f"{op}|{fam}|{n}", []).extend(runs)
        for (op, n), extra in over_floor(docs, first).items():
            floor.setdefault(f"{op}|{n}", []).append(extra)
        best, limits = best_of_job(docs), _job_limit(docs)
        in_place = (_job_limit(docs, staged=False) if any(map(reads_in_place, own)) else {})
        for (op, n), v in limits.items():
            limit_busbw.setdefault(f"{op}|{n}", []).append(v)
        for (op, n), v in in_place.items():
            in_place_busbw.setdefault(f"{op}|{n}", []).append(v)
        world = docs[0]["meta"]["nproc"]
        for (op, fam, n), (t, label) in best.items():
            key = f"{op}|{fam}|{n}"
            fam_times.setdefault(key, []).append(t)
            won.setdefault(key, {}).setdefault(label, 0)
            won[key][label] += 1
            peer = best_peer(best, op, n)
            if peer is not None and not is_peer(fam):
                vs_peer.setdefault(key, []).append(t / peer[0])
                if fam == first:
                    pk = f"{op}|{n}"
                    peer_won.setdefault(pk, {}).setdefault(peer[1], 0)
                    peer_won[pk][peer[1]] += 1
            if fam == first and (op, f"{first}#2", n) in best:
                aa.setdefault(f"{op}|{n}", []).append(best[(op, f"{first}#2", n)][0] / t)
            its_limits = in_place if reads_in_place(fam) else limits
            if _is_own(fam) and (op, n) in its_limits:
                by_family.setdefault(key, []).append(
                    busbw_gbs(op, n, t, world) / its_limits[(op, n)])
    fractions = {k: _spread(v) for k, v in by_family.items()}
    same_run = {k: _spread(v) for k, v in by_family_same_run.items()}
    return {
        "best_us": {k: _spread(v) for k, v in fam_times.items()},
        "best_won_by": won,
        "vs_best_peer": {k: _spread(v) for k, v in vs_peer.items()},
        "best_peer_won_by": peer_won,
        "aa": {k: _spread(v) for k, v in aa.items()},
        "limit_fraction": _of_family(fractions, first),
        "limit_fraction_same_run": _of_family(same_run, first),
        "limit_fraction_by_family": fractions,
        "limit_fraction_same_run_by_family": same_run,
        "over_floor_us": {k: _spread(v) for k, v in floor.items()},
        "limit_busbw": {k: _spread(v) for k, v in limit_busbw.items()},
        "limit_busbw_in_place": {k: _spread(v) for k, v in in_place_busbw.items()},
    }

