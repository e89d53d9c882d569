import json, statistics, glob, sys
d0=sys.argv[1]
res={}
for v in ("old","new"):
    for f in sorted(glob.glob(f"{d0}/{v}_*.json")):
        d=json.load(open(f))
        for r in d["results"]:
            res.setdefault((r["op"], r["bytes"], v), []).append(r["time_us"])
keys=sorted({(op,b) for op,b,v in res})
print("| op | bytes | hand-written µs (4 jobs) | plan walk µs | plan / hand-written |")
print("|---|---|---|---|---|")
for op,b in keys:
    o=res.get((op,b,"old"),[]); n=res.get((op,b,"new"),[])
    mo, mn = statistics.median(o), statistics.median(n)
    print(f"| {op} | {b} | {mo:.1f} ({min(o):.1f}–{max(o):.1f}) | {mn:.1f} ({min(n):.1f}–{max(n):.1f}) | {mn/mo:.2f} |")
