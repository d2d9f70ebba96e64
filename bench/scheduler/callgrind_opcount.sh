#!/usr/bin/env bash
# Per-call instruction counts (and, with --cache, simulated cache misses) of the
# scheduler hot paths at 100 / 10,000 / 100,000 live records, from callgrind:
# deterministic, so they compare runs on a busy machine where timings cannot.
#   bench/scheduler/callgrind_opcount.sh <build dir> [--cache]
# --cache simulates a 32 KiB 8-way L1d and a 1 MiB 16-way last level (an L2-sized
# cache: what a 100,000-record table overflows); misses are data read+write.
set -euo pipefail
build=${1:?usage: callgrind_opcount.sh <build dir> [--cache]}
cache=${2:-}
bin="$build/bin/scheduler_opcount"
calls=10000
out=$(mktemp)
trap 'rm -f "$out"' EXIT
sizes=(100 10000 100000)
printf '%-20s %28s %28s %28s\n' operation "${sizes[@]}"
for op in has_cache_item ensure1 ensure8 observe_ready expire_nothing_due expire_one_due; do
  row=$(printf '%-20s' "$op")
  for n in "${sizes[@]}"; do
    args=(--tool=callgrind --instr-atstart=no --callgrind-out-file="$out")
    [[ $cache == --cache ]] && args+=(--cache-sim=yes --D1=32768,8,64 --LL=1048576,16,64)
    valgrind "${args[@]}" "$bin" "$op" "$n" "$calls" > /dev/null 2>&1
    cell=$(awk -v calls="$calls" '
      /^events:/ { for (i = 2; i <= NF; ++i) name[i] = $i }
      /^totals:/ { for (i = 2; i <= NF; ++i) v[name[i]] = $i }
      END {
        s = sprintf("Ir %.0f", v["Ir"] / calls)
        if ("D1mr" in v) s = s sprintf(" L1 %.1f LL %.1f", (v["D1mr"] + v["D1mw"]) / calls, (v["DLmr"] + v["DLmw"]) / calls)
        print s
      }' "$out")
    row+=$(printf ' %28s' "$cell")
  done
  echo "$row"
done
