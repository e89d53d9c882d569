#!/usr/bin/env bash
# The collective tables of bench/README.md: every peer at its best, 3 fresh jobs each,
# both timing modes, 2 and 4 ranks, fp32 and bf16, 2 ranks under load (K = 1, 2, 4 per
# CPU, cpu and mem), small messages beside torch's dispatch floor, and pycomm's own
# algorithm crossover.
# Results (each job's raw JSON and the summary) go to records/collectives/; each summary's
# table goes into bench/README.md and the README's quotes are remade from them.
#
#   bash bench/run_tables.sh                      # main loaded small crossover
#   bash bench/run_tables.sh main                 # one group
#   bash bench/run_tables.sh mpirun-2r-fp32-b2b small loaded-2r-fp32-cpu4   # by name
set -u
cd "$(dirname "$0")/.."
OUT=records/collectives
mkdir -p "$OUT/crossover"
PEERS_MPI=pycomm,pycomm-api,pycomm-registered,gloo,deepspeed,mpi
PEERS_BF16=pycomm,pycomm-api,pycomm-registered,gloo,deepspeed   # MPI has no bfloat16 reductions
FULL=(-b 1K -e 64M -f 4 -n 10 -w 3)
run() {  # name, then bench.collectives flags
  local name=$1; shift
  echo "== $name $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  python -m bench.collectives "$@" --tuned --aa --jobs 3 --quiet --require-all \
    --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1 || { echo "!! $name failed: see $OUT/$name.log"; return; }
  # The new table into bench/README.md and the README's quoted figures from it, so that
  # results never land without what tests/test_readme_figures.py holds them to.
  python -m bench.tables --write-readme "$OUT/$name.json" > /dev/null \
    && python -m bench.quotes --write-readme > /dev/null \
    || echo "!! $name: bench/README.md or README.md not updated"
}
crossover() {  # name, nproc: pycomm's streamed algorithms against its direct one, one job
  echo "== $1 $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  python -m bench.algo_crossover --nproc "$2" -b 1K -e 256K --iters 400 --out "$OUT/crossover/$1.json" \
    > "$OUT/crossover/$1.log" 2>&1 || echo "!! $1 failed: see $OUT/crossover/$1.log"
}
config() {  # one table by its name
  local name=$1 np timing dtype kind k
  case $name in
    mpirun-[24]r-fp32-barrier|mpirun-[24]r-fp32-b2b)
      np=${name#mpirun-}; np=${np%%r-*}; timing=${name##*-}
      run "$name" --nproc "$np" "${FULL[@]}" --backends $PEERS_MPI --timing "$timing" ;;
    spawn-[24]r-bf16-barrier|spawn-[24]r-bf16-b2b)
      np=${name#spawn-}; np=${np%%r-*}; timing=${name##*-}
      run "$name" --nproc "$np" "${FULL[@]}" -d bfloat16 --backends $PEERS_BF16 --timing "$timing" ;;
    small-2r-fp32)  # below 4 KB, 200 iterations, with torch's dispatch floor as a column
      run "$name" --nproc 2 -b 16 -e 4K -f 4 -n 200 -w 200 --timing b2b \
        --backends pycomm,torch-floor,pycomm-api,gloo,deepspeed,mpi ;;
    loaded-2r-fp32-cpu[0-9]*|loaded-2r-fp32-mem[0-9]*)
      kind=${name#loaded-2r-fp32-}; k=${kind//[a-z]/}; kind=${kind//[0-9]/}
      run "$name" --nproc 2 -b 1K -e 32M -f 32 -n 5 -w 2 --backends $PEERS_MPI \
        --load "$k" --load-kind "$kind" ;;
    crossover-[24]r)
      np=${name#crossover-}; crossover "$name" "${np%r}" ;;
    *) echo "!! unknown table $name"; return 1 ;;
  esac
}
names=()
for what in "${@:-main loaded small crossover}"; do
  for w in $what; do
    case $w in
      main)
        for np in 2 4; do
          names+=("mpirun-${np}r-fp32-barrier" "mpirun-${np}r-fp32-b2b"
                  "spawn-${np}r-bf16-barrier" "spawn-${np}r-bf16-b2b")
        done ;;
      small) names+=(small-2r-fp32) ;;
      loaded)  # K = 1, 2, 4 of each kind, the smaller loads first (LOADS=... picks)
        for k in ${LOADS:-1 2 4}; do names+=("loaded-2r-fp32-cpu$k" "loaded-2r-fp32-mem$k"); done ;;
      crossover) names+=(crossover-2r crossover-4r) ;;
      *) names+=("$w") ;;
    esac
  done
done
for name in "${names[@]}"; do config "$name"; done
echo "== done $(date -u +%H:%M:%S)"
