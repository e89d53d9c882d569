#!/usr/bin/env bash
# Issue 30's tables: every peer at its best, 3 fresh jobs each, both timing modes, 2 and
# 4 ranks, fp32 and bf16, 2 ranks under load (K = 1, 2, 4 per CPU, cpu and mem), and
# small messages beside torch's dispatch floor.
# Results (each job's raw JSON and the summary) go to bench/results/i30/.
set -u
cd "$(dirname "$0")/.."
OUT=bench/results/i30
mkdir -p "$OUT"
PEERS_MPI=pycomm,pycomm-api,gloo,deepspeed,mpi
PEERS_BF16=pycomm,pycomm-api,gloo,deepspeed   # MPI has no bfloat16 reductions
run() {  # name, then bench.collectives flags
  local name=$1; shift
  echo "== $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  python -m bench.collectives "$@" --tuned --aa --jobs 3 --quiet --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1 || echo "!! $name failed: see $OUT/$name.log"
}
FULL=(-b 1K -e 64M -f 4 -n 10 -w 3)
for what in "${@:-main loaded small}"; do
  case $what in
    main)
      for np in 2 4; do
        for timing in barrier b2b; do
          run "mpirun-${np}r-fp32-$timing" --nproc $np "${FULL[@]}" --backends $PEERS_MPI --timing $timing
        done
        run "spawn-${np}r-bf16-barrier" --nproc $np "${FULL[@]}" -d bfloat16 --backends $PEERS_BF16
      done ;;
    small)  # below 4 KB, 200 iterations, with torch's dispatch floor timed as a column
      run "small-2r-fp32" --nproc 2 -b 16 -e 4K -f 4 -n 200 -w 200 --timing b2b \
        --backends pycomm,torch-floor,pycomm-api,gloo,deepspeed,mpi ;;
    loaded)  # K = 1, 2, 4 of each kind, the smaller loads first (LOADS=... picks)
      for k in ${LOADS:-1 2 4}; do
        for kind in cpu mem; do
          run "loaded-2r-fp32-$kind$k" --nproc 2 -b 1K -e 32M -f 32 -n 5 -w 2 \
            --backends $PEERS_MPI --load $k --load-kind $kind
        done
      done ;;
  esac
done
echo "== done $(date -u +%H:%M:%S)"
