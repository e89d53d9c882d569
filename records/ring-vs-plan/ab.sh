#!/bin/bash
# A/B of two builds of pycomm._C (OLD_SO, NEW_SO), alternating which runs first, 4 fresh
# jobs each: 2 ranks (a core each), the ops given, 8 KB to 8 MB. Usage, from the root:
#   OLD_SO=/tmp/old_C.so NEW_SO=/tmp/new_C.so OUT=dir OPS=all_gather,broadcast bash ab.sh
# then: python records/ring-vs-plan/summary.py dir
set -eu
SO=$(ls pycomm/_C.*.so)
cp "$SO" /tmp/ab_keep.so
for i in 1 2 3 4; do
  if [ $((i % 2)) = 1 ]; then order="new old"; else order="old new"; fi
  for v in $order; do
    if [ "$v" = old ]; then cp "$OLD_SO" "$SO"; else cp "$NEW_SO" "$SO"; fi
    python -m bench.collectives --backends pycomm --nproc 2 --ops "$OPS" -b 8K -e 8M -f 4 \
      -n 100 -w 20 --quiet --out "$OUT/${v}_$i.json" > "$OUT/${v}_$i.log" 2>&1
  done
done
cp /tmp/ab_keep.so "$SO"
