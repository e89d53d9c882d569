# A/B of PYCOMM_WAIT_SLICE_US under load, with gloo on the loopback (its best here) in
# the same job, interleaved: python ab_slice.py BYTES K cpu|mem ROUNDS [variants]
# Per round and variant a fresh 2-rank job; each rank's median over 7 calls (a barrier
# before each), and the slower rank's median counts.
import os, sys, statistics
sys.path.insert(0, "/work/main")
from bench import sched_share as ss
from bench._load import competing
from bench import _c2c
from pycomm.testing import run_ranks
if __name__ == '__main__':
    size = int(sys.argv[1]); load = int(sys.argv[2]); kind = sys.argv[3]; rounds = int(sys.argv[4])
    variants = {"pycomm-slice0": ("pycomm", {"PYCOMM_WAIT_SLICE_US": "0"}),
                "pycomm": ("pycomm", {}),
                "gloo-lo": ("gloo", {"GLOO_SOCKET_IFNAME": "lo"})}
    only = sys.argv[5].split(",") if len(sys.argv) > 5 else list(variants)
    out = {k: [] for k in only}
    print("# size", size, "load", load, kind, open("/proc/loadavg").read().strip(), flush=True)
    print("# c2c before:", _c2c.describe(_c2c.reading()), flush=True)
    with competing(load, kind):
        for r in range(rounds):
            for name in only:
                be, env = variants[name]
                res = run_ranks(ss.rank_body, 2, size, 7, 2, backend=be, timeout_s=600, env=env)
                wall = max(m["wall_ms"] for m in res)
                out[name].append(wall)
                print(name, " ".join(ss.row(be, i, m) for i, m in enumerate(res)), flush=True)
    print("# c2c after:", _c2c.describe(_c2c.reading()), flush=True)
    for k, v in out.items():
        print(f"{k:15s} median {statistics.median(v):7.2f}  range {min(v):.2f}-{max(v):.2f}  n={len(v)}")
