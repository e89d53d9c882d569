# A/B of pycomm settings under load, interleaved, each round a fresh 2-rank job per
# variant: python ab_env.py BYTES K cpu|mem ROUNDS NAME=VAR:VAL/VAR:VAL ...
# ("plain=" is pycomm as it comes). Per job each rank's median over 7 calls (a barrier
# before each); the slower rank's median counts.
import os, sys, statistics
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../.."))
from bench import sched_share as ss
from bench._load import competing
from bench import _c2c
from pycomm.testing import run_ranks
if __name__ == '__main__':
    size = int(sys.argv[1]); load = int(sys.argv[2]); kind = sys.argv[3]; rounds = int(sys.argv[4])
    variants = {}
    for spec in sys.argv[5:]:
        name, _, env = spec.partition("=")
        variants[name] = dict(kv.split(":", 1) for kv in env.split("/") if kv)
    out = {k: [] for k in variants}
    print("# size", size, "load", load, kind, open("/proc/loadavg").read().strip(), flush=True)
    print("# c2c before:", _c2c.describe(_c2c.reading()), flush=True)
    with competing(load, kind):
        for r in range(rounds):
            for name, env in variants.items():
                res = run_ranks(ss.rank_body, 2, size, 7, 2, timeout_s=600, env=env)
                out[name].append(max(m["wall_ms"] for m in res))
                print(name, " ".join(ss.row("pycomm", i, m) for i, m in enumerate(res)), flush=True)
    print("# c2c after:", _c2c.describe(_c2c.reading()), flush=True)
    for k, v in out.items():
        print(f"{k:15s} median {statistics.median(v):8.4f}  range {min(v):.4f}-{max(v):.4f}  n={len(v)}")
