#!/usr/bin/env bash
# The staging pipeline's settings against each other on the GPU host: one
# daemon per configuration (staging_slots x staging_slot_bytes x
# staging_writes, fill_threads), staged loads of the same plan from each in
# turn, several rounds, medians against the ceiling measured in the same run.
# docs/benchmarks.md ("The staging pipeline's settings") says why each is
# tried and what the defaults follow from.
#
#   tests/gpu/staging.sh BUILD_DIR WORK_DIR
#
# BUILD_DIR holds weightd, weightctl and weightd-bench (Release, CUDA);
# WORK_DIR gets the Qwen3-4B layout checkpoint (generated when absent, 7.49
# GiB), the sockets, the daemons' logs and json/. Every daemon runs with
# pin=off (every load staged) and log_level=debug: its log has one line per
# staged load with the fill threads' time filling and waiting for slots.
#
# Each round takes the configurations in another order (rotated by one), so
# that none always runs first after the ceiling or last before the next plan.
# The script prints glibc's version and GLIBC_TUNABLES: memcpy switches to
# non-temporal stores above a size glibc derives from the cache (a quarter of
# the last-level cache on glibc 2.38 and later), far above the fill tasks'.
#
# Environment: OUT (a folder: staging.json and the logs' load lines are copied
# there), STAGING_ROUNDS (3), STAGING_RUNS (3 loads per round and
# configuration), STAGING_CONFIGS (a file of configurations, one per line:
# NAME [KEY=VALUE...], '#' lines skipped, replacing the list below; a name
# alone runs the defaults), STAGING_PLANS ("tp2 whole"), STAGING_PRESET
# (qwen3-4b; a dry run takes a smaller one).
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR WORK_DIR" >&2; exit 2; }
build=$(cd "$1" && pwd) work=$2
mkdir -p "$work" && work=$(cd "$work" && pwd)
rounds=${STAGING_ROUNDS:-3}
runs=${STAGING_RUNS:-3}
plans=${STAGING_PLANS:-tp2 whole}
json=$work/staging-json
mkdir -p "$json"
rm -f "$json"/*.json
t_start=$(date +%s)
say() { echo "== $(date +%T) (+$(($(date +%s) - t_start)) s) $*"; }

# The defaults (4 x 16 MiB, plain stores) against the settings around them
# and the old default (2 x 64 MiB); docs/benchmarks.md has the full tables.
configs=$(
  cat <<'EOF'
default
2x64 staging_slots=2 staging_slot_bytes=64MiB
2x32 staging_slots=2 staging_slot_bytes=32MiB
4x12 staging_slots=4 staging_slot_bytes=12MiB
4x24 staging_slots=4 staging_slot_bytes=24MiB
8x16 staging_slots=8 staging_slot_bytes=16MiB
8x8 staging_slots=8 staging_slot_bytes=8MiB
4x16-streaming staging_writes=streaming
4x16-wc staging_writes=write_combined
EOF
)
[ -n "${STAGING_CONFIGS:-}" ] && configs=$(cat "$STAGING_CONFIGS")
set -f # KEY=VALUE words are not globs
echo "$(ldd --version 2>&1 | head -1); GLIBC_TUNABLES=${GLIBC_TUNABLES:-(unset)}"

declare -A pids
stop_all() { for n in "${!pids[@]}"; do kill "${pids[$n]}" 2>/dev/null; done; wait 2>/dev/null; }
trap stop_all EXIT

preset=${STAGING_PRESET:-qwen3-4b}
qwen=$work/$preset
if [ ! -f "$qwen/config.json" ]; then
  say "generate $preset"
  "$build/weightctl" mkcheckpoint --preset "$preset" --seed 1 --out "$qwen" >/dev/null || exit 1
fi
say "sync (write back the checkpoint: loads timed during write-back run slow)"
sync

names=()
while read -r name sets; do
  [ -n "$name" ] && [[ "$name" != \#* ]] || continue
  args=()
  for kv in $sets; do args+=(--set "$kv"); done
  sock=$work/st-$name.sock
  rm -f "$sock"
  "$build/weightd" --foreground --backend cuda --socket "$sock" --model-root "$work" --set metrics_address= \
    --set pin=off --set log_level=debug "${args[@]}" >"$work/st-$name.log" 2>&1 &
  pids[$name]=$!
  names+=("$name")
done <<<"$configs"
set +f
for name in "${names[@]}"; do
  for _ in $(seq 300); do
    [ -S "$work/st-$name.sock" ] && break
    kill -0 "${pids[$name]}" 2>/dev/null || break
    sleep 0.1
  done
  [ -S "$work/st-$name.sock" ] || { echo "weightd $name did not start:"; tail -n 5 "$work/st-$name.log"; }
done

plan_json() { # tp2 | whole
  case $1 in
  tp2) echo '{"preset":"auto","tp_size":2,"tp_rank":0,"fuse":true}' ;;
  *) echo '' ;;
  esac
}
bench_on() { # NAME PLAN PHASES OUTFILE
  local plan
  plan=$(plan_json "$2")
  timeout 120 "$build/weightd-bench" --runs "$runs" --settle-ms 200 --no-b2b --checkpoint "$qwen" \
    --socket "$work/st-$1.sock" ${plan:+--plan "$plan"} --phases "$3" --label "$1 $2" --json-out "$4" >/dev/null 2>&1 ||
    echo "!! $1 $2 $3: exit $?"
}

first=
for name in "${names[@]}"; do [ -S "$work/st-$name.sock" ] && first=$name && break; done
[ -n "$first" ] || { echo "no daemon started" >&2; exit 1; }
for plan in $plans; do
  say "ceiling and fill, $plan (before)"
  bench_on "$first" "$plan" ceiling,fill "$json/ceiling-$plan-0.json"
done
n=${#names[@]}
for r in $(seq "$rounds"); do
  for plan in $plans; do
    say "round $r, $plan"
    for i in $(seq 0 $((n - 1))); do
      name=${names[$(((i + r - 1) % n))]}
      [ -S "$work/st-$name.sock" ] && bench_on "$name" "$plan" staged "$json/staged-$name-$plan-$r.json"
    done
  done
done
for plan in $plans; do
  say "ceiling and fill, $plan (after)"
  bench_on "$first" "$plan" ceiling,fill "$json/ceiling-$plan-1.json"
done

say "summary"
python3 - "$json" "${OUT:-}" "$work" "${names[@]}" <<'EOF'
import glob, json, os, re, statistics, sys
d, out, work, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
# Per configuration and slab size: the fill threads' time filling and waiting for slots, from the debug log.
LINE = re.compile(r"staged (\d+) slab bytes in ([\d.]+) ms .* filled ([\d.]+) ms and waited for slots ([\d.]+) ms")
threads = {}
for name in names:
    try:
        text = open(os.path.join(work, f"st-{name}.log")).read()
    except OSError:
        continue
    for b, ms, fill, wait in LINE.findall(text):
        threads.setdefault((name, int(b)), []).append((float(ms), float(fill), float(wait)))
GiB = float(1 << 30)
def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
result = {}
for plan in ("tp2", "whole"):
    ceil = [load(p) for p in sorted(glob.glob(f"{d}/ceiling-{plan}-*.json"))]
    ceil = [c for c in ceil if c and "ceiling_h2d_s" in c]
    if not ceil:
        continue
    c = statistics.median(x["ceiling_h2d_s"] for x in ceil)
    each = ", ".join("%.1f" % (x["ceiling_h2d_s"] * 1e3) for x in ceil)
    print(f"\n{plan}: ceiling {c * 1e3:.1f} ms (before, after: {each})")
    fills = {}
    for k in ("fill_gather_s", "fill_gather_streaming_s", "fill_gather_write_combined_s", "fill_rows_s"):
        v = [x[k] for x in ceil if k in x]
        if v:
            fills[k] = statistics.median(v)
            print(f"  {k[:-2]:<28} {fills[k] * 1e3:7.1f} ms  {c / fills[k] * 100:5.0f}% of the ceiling")
    rows = {}
    for name in names:
        v = []
        for p in sorted(glob.glob(f"{d}/staged-{name}-{plan}-*.json")):
            j = load(p)
            if j and "staged" in j and j["staged"].get("method") == "staged":
                v += j["staged"]["runs_s"]
        if v:
            m = statistics.median(v)
            rows[name] = {"median_s": m, "runs_s": v, "of_ceiling": c / m}
            each = " ".join("%.0f" % (x * 1e3) for x in v)
            sizes = sorted({b for (n, b) in threads if n == name})  # the TP=2 rank is the smaller slab
            mine = threads.get((name, sizes[-1] if plan == "whole" else sizes[0]), []) if sizes else []
            fill = statistics.median(x[1] for x in mine) if mine else 0
            wait = statistics.median(x[2] for x in mine) if mine else 0
            rows[name].update({"fill_thread_ms": fill, "wait_thread_ms": wait})
            print(f"  staged {name:<22} {m * 1e3:7.1f} ms  {c / m * 100:5.0f}%   fill/wait thread-ms {fill:6.0f} {wait:6.0f}   runs {each}")
        else:
            print(f"  staged {name:<22} no loads")
    result[plan] = {"ceiling_s": c, "fill": fills, "staged": rows}
if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "staging.json"), "w") as f:
        json.dump(result, f, indent=1)
EOF
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/staging-logs"
  for name in "${names[@]}"; do grep -E "staged [0-9]+ slab bytes|staging slots|error" "$work/st-$name.log" >"$OUT/staging-logs/$name.log"; done
  cp "$json"/*.json "$OUT/staging-logs/" 2>/dev/null
fi
say "done"
