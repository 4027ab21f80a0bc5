#!/usr/bin/env bash
# The speed issue's measurements in one run on the GPU host (one H200, 16
# cores, 128 GiB, 64 GB disk): about 4-6 minutes, everything against
# ceilings measured in the same run. docs/benchmarks.md says what each
# section measures and why.
#
#   tests/gpu/speed.sh BUILD_DIR WORK_DIR
#
# BUILD_DIR holds weightd, weightctl and weightd-bench (a Release build with
# CUDA); WORK_DIR gets the checkpoints (generated when absent: the Qwen3-4B
# layout, 7.49 GiB on disk, and DeepSeek-V3 sparse, 673 GB that take ~12 MB),
# the daemons' sockets and logs, and json/ with every section's result and
# json/charts/ with the SVG charts of them (tests/gpu/charts.py). Run as
# root for the cold path (the page cache dropped); without root it falls back
# to posix_fadvise and says so. Peers are timed when their Python packages
# are installed (tests/gpu/fetch-wheels.sh carries them), else skipped with a
# line.
#
# Sections (each under a time limit; one that fails is reported and the run
# goes on):
#   X  two builds compared in one run (SPEED_BASELINE=BUILD_DIR of the other,
#      e.g. main): a daemon of each, pin off, staged and pinned loads of the
#      whole set and the TP=2 rank alternating between them; the medians'
#      difference in points of the ceiling, against the runs' spread
#   A  whole set and TP=2 fused rank: ceiling, fill (gather, rows), staged
#      (two daemons, staged_strided gather and rows, loads alternating),
#      pin once, pinned-resident, attach, daemon RssAnon       [pin off]
#   C  the default configuration (pin after_load): first load, the wait
#      until the daemon has pinned by itself, later loads (whole and TP=2)
#   D  pin on_open: the same, pinned from the open on
#   P  peers, warm, the same checkpoint, against C's later loads
#   I  the digests' cost: loads with scrub on (digests recorded) and off,
#      alternating, the scrub kernel's rate over the resident whole set, and
#      a matmul loop's slowdown while the background scrub runs at its
#      default duty
#   S  DeepSeek-V3 (sparse) EP8 rank 0 (~94 GiB): open + plan, one load with
#      the O_DIRECT source (holes read as zeros, no disk), prefetch, one staged
#      load, pin per plan, one pinned load, attach, RssAnon
#   K  cold: the page cache dropped; the disk's O_DIRECT ceiling as the best
#      of a sweep over threads, read sizes and io_uring depths, a cold load
#      with the default configuration and one with the O_DIRECT source (the
#      page cache's share before and after each), InstantTensor's cold
#      default
#
# Environment: OUT (a folder: speed.json, the raw JSON, the charts and the
# logs are copied there), SPEED_RUNS (5), SPEED_PRESET (qwen3-4b), SPEED_BASELINE
# (section X's other build), SPEED_SKIP (section
# letters to leave out, e.g. "PK"), SPEED_DSV3_LAYERS / SPEED_DSV3_EXPERTS
# (cut the DeepSeek layout for a dry run), SPEED_NO_ATTACH=1 (dry runs
# without a GPU: tests/gpu/dryrun.sh).
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR WORK_DIR" >&2; exit 2; }
build=$(cd "$1" && pwd) work=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$work" && work=$(cd "$work" && pwd)
runs=${SPEED_RUNS:-5}
preset=${SPEED_PRESET:-qwen3-4b}
skip=${SPEED_SKIP:-}
json=$work/json
mkdir -p "$json"
rm -f "$json"/*.json "$work"/*.log
t_start=$(date +%s)
failed=()

say() { echo "== $(date +%T) (+$(($(date +%s) - t_start)) s) $*"; }
want() { [[ "$skip" != *"$1"* ]]; }

# ---- daemons ------------------------------------------------------------------------
declare -A pids
start_daemon() { # NAME [--set KEY=VALUE]...
  local name=$1
  shift
  local sock=$work/$name.sock
  rm -f "$sock"
  # No metrics: several daemons run at once and would all want 127.0.0.1:9477.
  "$build/weightd" --foreground --backend cuda --socket "$sock" --model-root "$work" --set metrics_address= "$@" \
    >"$work/$name.log" 2>&1 &
  pids[$name]=$!
  for _ in $(seq 300); do
    [ -S "$sock" ] && return 0
    kill -0 "${pids[$name]}" 2>/dev/null || break
    sleep 0.1
  done
  echo "weightd $name did not start:" >&2
  tail -n 20 "$work/$name.log" >&2
  return 1
}
stop_daemon() {
  local name=$1 pid=${pids[$1]:-}
  [ -n "$pid" ] || return 0
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  unset "pids[$name]"
}
stop_all() { for n in "${!pids[@]}"; do stop_daemon "$n"; done; }
trap stop_all EXIT

# Runs one measurement under a time limit; a failure is reported, the run goes on.
run() { # LABEL LIMIT_S COMMAND...
  local label=$1 limit=$2
  shift 2
  say "$label"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "!! $label: exit $rc" >&2
    failed+=("$label (exit $rc)")
  fi
  return $rc
}

bench=("$build/weightd-bench" --runs "$runs")

attach_phases=attach,rss
[ "${SPEED_NO_ATTACH:-0}" = 1 ] && attach_phases=rss

# ---- checkpoints --------------------------------------------------------------------
qwen=$work/$preset
dsv3=$work/deepseek-v3-sparse
if [ ! -f "$qwen/config.json" ]; then
  run "generate $preset" 300 "$build/weightctl" mkcheckpoint --preset "$preset" --seed 1 --out "$qwen" || exit 1
fi
if want S && [ ! -f "$dsv3/model.safetensors.index.json" ]; then
  cut=()
  [ -n "${SPEED_DSV3_LAYERS:-}" ] && cut+=(--layers "$SPEED_DSV3_LAYERS")
  [ -n "${SPEED_DSV3_EXPERTS:-}" ] && cut+=(--experts "$SPEED_DSV3_EXPERTS")
  run "generate deepseek-v3 (sparse)" 120 "$build/weightctl" mkcheckpoint --preset deepseek-v3 --sparse "${cut[@]}" --out "$dsv3"
fi
# A checkpoint written just now is still being written back (7.49 GiB at the
# host's ~1 GB/s takes seconds): loads timed meanwhile ran at half speed on the
# H200 host (322, 305, 263, 232 ms, then 194 ms). Measure the steady state.
run "sync (write back the generated checkpoints)" 300 sync
TP2='{"preset":"auto","tp_size":2,"tp_rank":0,"fuse":true}'
EP8='{"preset":"auto","ep_size":8,"ep_rank":0}'
cat /proc/meminfo | head -3
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null || true
df -h "$work" | tail -1

# ---- X: two builds, alternating ---------------------------------------------------------------
if want X; then
  base=${SPEED_BASELINE:-}
  if [ -z "$base" ] || [ ! -x "$base/weightd" ]; then
    echo "X: SPEED_BASELINE names no build with a weightd: section skipped"
  else
    base=$(cd "$base" && pwd)
    start_daemon new --set pin=off && {
      sock=$work/main.sock
      rm -f "$sock"
      "$base/weightd" --foreground --backend cuda --socket "$sock" --model-root "$work" --set metrics_address= \
        --set pin=off >"$work/main.log" 2>&1 &
      pids[main]=$!
      for _ in $(seq 300); do [ -S "$sock" ] && break; sleep 0.1; done
      run "X1 whole set, this build vs $base (alternating)" 240 \
        "${bench[@]}" --checkpoint "$qwen" --socket "$work/new.sock" --alt-socket "$sock" --names new,main \
        --phases ceiling,staged,pin,pinned --label "whole, two builds" --json-out "$json/X1_whole.json"
      run "X2 TP=2 fused rank 0, this build vs $base (alternating)" 240 \
        "${bench[@]}" --checkpoint "$qwen" --socket "$work/new.sock" --alt-socket "$sock" --names new,main \
        --plan "$TP2" --phases ceiling,staged,pin,pinned --label "TP=2 fused, two builds" --json-out "$json/X2_tp2.json"
    }
    stop_daemon new
    stop_daemon main
  fi
fi

# ---- A: staged (gather vs rows), pinned, attach -------------------------------------------
if want A; then
  start_daemon gather --set pin=off --set staged_strided=gather &&
    start_daemon rows --set pin=off --set staged_strided=rows && {
    run "A1 whole set: ceiling, fill, staged, pin, pinned, attach, RSS" 240 \
      "${bench[@]}" --checkpoint "$qwen" --socket "$work/gather.sock" \
      --phases "ceiling,fill,staged,pin,pinned,$attach_phases" --label "whole, pin off" --json-out "$json/A1_whole.json"
    run "A2 TP=2 fused rank 0: ceiling, fill, staged gather vs rows (alternating), pin per plan, pinned" 240 \
      "${bench[@]}" --checkpoint "$qwen" --socket "$work/gather.sock" --alt-socket "$work/rows.sock" --plan "$TP2" \
      --phases "ceiling,fill,staged,pin,pinned" --label "TP=2 fused, pin off" --json-out "$json/A2_tp2.json"
  }
  stop_daemon gather
  stop_daemon rows
fi

# ---- C, D: the pin policy ---------------------------------------------------------------------
if want C; then
  start_daemon default && {
    run "C1 default configuration (pin after_load), whole set" 120 \
      "${bench[@]}" --checkpoint "$qwen" --socket "$work/default.sock" --phases ceiling,auto \
      --label "whole, default config" --json-out "$json/C1_auto_whole.json"
    run "C2 default configuration (pin after_load), TP=2 fused rank 0" 120 \
      "${bench[@]}" --checkpoint "$qwen" --socket "$work/default.sock" --plan "$TP2" --phases ceiling,auto \
      --label "TP=2 fused, default config" --json-out "$json/C2_auto_tp2.json"
  }
  stop_daemon default
fi
if want D; then
  start_daemon onopen --set pin=on_open && run "D1 pin on_open, whole set" 120 \
    "${bench[@]}" --checkpoint "$qwen" --socket "$work/onopen.sock" --phases ceiling,auto \
    --label "whole, pin on_open" --json-out "$json/D1_on_open_whole.json"
  stop_daemon onopen
fi

# ---- P: peers, warm ---------------------------------------------------------------------------
if want P; then
  run "P peers, warm, same checkpoint" 420 python3 "$here/peers.py" --checkpoint "$qwen" --runs 3 \
    --weightd-json "$json/C1_auto_whole.json" --json-out "$json/P_peers.json"
fi

# ---- I: the digests' cost (scrub on) and the scrub kernel ------------------------------------
if want I; then
  # scrub_duty=0: no background scrub runs while loads are timed.
  start_daemon digests --set pin=off --set scrub=on --set scrub_duty=0 &&
    start_daemon nodigests --set pin=off && {
    run "I1 whole set: staged and pinned loads, scrub on (digests recorded) vs off (alternating)" 240 \
      "${bench[@]}" --checkpoint "$qwen" --socket "$work/digests.sock" --alt-socket "$work/nodigests.sock" \
      --names digests,none --phases ceiling,staged,pin,pinned --label "whole, digests vs none" \
      --json-out "$json/I1_digests.json"
    run "I2 TP=2 fused rank 0: the same" 240 \
      "${bench[@]}" --checkpoint "$qwen" --socket "$work/digests.sock" --alt-socket "$work/nodigests.sock" \
      --names digests,none --plan "$TP2" --phases ceiling,staged --label "TP=2 fused, digests vs none" \
      --json-out "$json/I2_digests_tp2.json"
    # A scrub of the resident whole set, three times: its bytes and seconds (the kernel's rate).
    "$build/weightctl" --socket "$work/digests.sock" load "$qwen" >/dev/null &&
      for _ in 1 2 3; do
        run "I3 scrub of the whole set" 120 "$build/weightctl" --socket "$work/digests.sock" --json scrub |
          python3 -c 'import json,sys; t=[l for l in sys.stdin.read().splitlines() if l.startswith("{")]; r=json.loads(t[-1]) if t else {"sets": [], "clean": None}
for s in r["sets"]:
    if "bytes" in s: print("I3 scrub %s: %d tensors, %d bytes in %.3f s = %.1f GB/s, clean %s" % (s["set"], s["tensors"], s["bytes"], s["seconds"], s["bytes"]/max(s["seconds"],1e-9)/1e9, r["clean"]))'
      done
  }
  stop_daemon digests
  stop_daemon nodigests
  # I4: the background scrub at its default duty, back to back (interval 1 ms), over the resident whole set,
  # against a matmul loop: scrubbing vs the daemon stopped, alternating (tests/gpu/matmul_scrub.py).
  start_daemon bgscrub --set pin=off --set scrub=on --set scrub_interval_ms=1 --set metrics_address=127.0.0.1:9479 &&
    "$build/weightctl" --socket "$work/bgscrub.sock" load "$qwen" >/dev/null &&
    run "I4 background scrub (default duty, back to back) vs stopped: 8192^2 BF16 matmul loop" 180 \
      python3 "$here/matmul_scrub.py" --pid "${pids[bgscrub]}" --metrics http://127.0.0.1:9479/metrics \
      --json-out "$json/I4_matmul_scrub.json"
  stop_daemon bgscrub
fi

# ---- S: DeepSeek-V3 sparse, EP8 rank ----------------------------------------------------------
if want S && [ -f "$dsv3/model.safetensors.index.json" ]; then
  rank=$("$build/weightctl" plan "$dsv3" --preset auto --ep-size 8 --ep-rank 0 | awk '/^payload bytes/ {print $3}')
  mem=$(($(awk '/^MemTotal/ {print $2}' /proc/meminfo) * 1024))
  phases=open,ceiling,direct,prefetch,fill,staged # fill: what limits the staged load
  # Pinning the rank holds all of it in memory at once: only with 24 GiB (or a fifth of memory) to spare.
  spare=$((24 << 30))
  [ $((mem / 5)) -lt "$spare" ] && spare=$((mem / 5))
  if [ -n "$rank" ] && [ "$mem" -gt $((rank + spare)) ]; then
    phases=$phases,pin,pinned
    budget=$((rank + (4 << 30)))
  else
    echo "S: pinning a rank of $rank bytes needs more than $mem bytes of memory: pin and pinned left out"
    budget=0
  fi
  phases=$phases,$attach_phases
  start_daemon dsv3 --set pin=off --set host_pin_budget="$budget" && run "S DeepSeek-V3 sparse, EP8 rank 0 ($rank bytes)" 420 \
    "$build/weightd-bench" --runs 1 --no-b2b --ceiling-max-gib 16 --checkpoint "$dsv3" --socket "$work/dsv3.sock" \
    --plan "$EP8" --phases "$phases" --label "DeepSeek-V3 sparse, EP8 rank 0" --json-out "$json/S_dsv3_ep8.json"
  stop_daemon dsv3
fi

# ---- K: cold --------------------------------------------------------------------------------
if want K; then
  start_daemon cold && run "K1 cold: O_DIRECT ceiling and a cold load (default configuration)" 240 \
    "${bench[@]}" --checkpoint "$qwen" --socket "$work/cold.sock" --phases cold --label "cold, default config" \
    --json-out "$json/K1_cold.json"
  stop_daemon cold
  if want P; then
    run "K2 peers, cold" 240 python3 "$here/peers.py" --checkpoint "$qwen" --runs 1 --cold \
      --weightd-json "$json/K1_cold.json" --json-out "$json/K2_peers_cold.json"
  fi
fi

# ---- the summary ----------------------------------------------------------------------------
say "summary"
python3 "$here/speed_report.py" "$json" ${OUT:+--out "$OUT/speed.json"}
# The charts beside the JSON they are drawn from (docs/benchmarks.md, "Charts").
python3 "$here/charts.py" --out "$json/charts" "$json" || failed+=("charts")
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/raw" "$OUT/charts"
  cp "$json"/*.json "$OUT/raw/" 2>/dev/null
  cp "$json"/charts/*.svg "$OUT/charts/" 2>/dev/null
  for f in "$work"/*.log; do tail -n 300 "$f" >"$OUT/raw/$(basename "$f")"; done
fi
say "done in $(($(date +%s) - t_start)) s"
if [ ${#failed[@]} -gt 0 ]; then
  printf '!! failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
