#!/usr/bin/env bash
# The GPU matrix of issue 21, in parts that each fit one 600-s call of the device tool (docs/GPU_MATRIX.md says which
# calls, what each part measures and what to check). The GPU machine reaches no network: the call carries
# .gpu-wheels (the GPU set's missing wheels) and .gpu-tokenizer.tar.gz (GPT-OSS's tokenizer, saved offline).
#
#   bash bench/gpu_matrix.sh 1                  # part 1 on the GPU machine (parts 1-3: one session's 30 minutes)
#   bash bench/gpu_matrix.sh 4 --only 4.4       # some items of a part again (the leftovers a part names)
#   bash bench/gpu_matrix.sh --dry-run all      # the commands, one per line, nothing run (valid bash)
#   bash bench/gpu_matrix.sh --cpu 3            # the tiny items on a CPU (gpu_check --cpu): the plumbing
#   bash bench/gpu_matrix.sh --summary a.json b.json   # the issue's targets over the results of several parts
#
# Each part writes three files under $OUT (default /tmp/gpu-matrix-out; the device tool returns at most 8):
# partN.log (this console), partN-results.json (every item: status, time, its JSON), partN-logs.tar.gz (each
# item's console, training.log, metrics). An item that fails never stops the part; one whose estimate no longer fits
# the part's budget is skipped and named, with the command that runs it. The estimates (H100, seconds) are guesses
# from the one H100 run so far (GUIDE 4b: 19.5 / 33 s per step at 200 tokens, 46.5 ms per decode step) plus
# imports, loads and compiles; the budget guard, not the estimate, keeps a part inside its call.
# shellcheck disable=SC2086  # $L20 and $tiny are lists of flags, split on purpose (check() joins words into one line)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

usage() {
  echo "usage: bash bench/gpu_matrix.sh [--dry-run|--cpu] PART|all [--only ID,ID...]   (PART: 1-5)" >&2
  echo "       bash bench/gpu_matrix.sh --summary RESULTS.json..." >&2
  exit 2
}

MODE=gpu PART="" ONLY=""
while (($#)); do
  case $1 in
    --dry-run) MODE=dry ;;
    --cpu) MODE=cpu ;;
    --summary) shift; MODE=summary; break ;;
    --only) ONLY=${2:?--only needs item ids, e.g. 2.3,2.4}; shift ;;
    [1-5] | all) PART=$1 ;;
    *) usage ;;
  esac
  shift
done

OUT=${OUT:-/tmp/gpu-matrix-out}
WORK=${WORK:-/tmp/gpu-matrix}         # tiny runs, small saves, the unpacked tokenizer
PY=${PYTHON:-python3}                 # the GPU machine's python3 holds torch; here the project's venv
JOBS=${JOBS:-5}                       # items marked bg that may run together (16 cores, 80 GB: tiny models)
BUDGET_S=${BUDGET_S:-575}             # a part's seconds, setup included: the device tool stops a call at 600
GUARD=${GUARD:-1}                     # 0: start an item even when its estimate exceeds the time left
TINY_TOKENS=256                       # tiny runs check plumbing: past the 128-token sliding window, not the budget
EVAL_EXTRA=""
if [ "$MODE" = cpu ]; then
  [ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
  JOBS=1 BUDGET_S=${CPU_BUDGET_S:-3600} TINY_TOKENS=16 EVAL_EXTRA=" --max_new_tokens 32"
fi
TOK=$WORK/gpt-oss-tokenizer

# --- the targets, and each part's results: one Python program, two uses -----------------------------------------

summarise() {  # summarise collect LOGS PART OUT_JSON | summarise targets RESULTS.json...
  "$PY" - "$@" <<'PY'
import json, sys
from pathlib import Path

def load_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None

def collect(logs, part, out):
    """Every item's status line, command and JSON (gpu_check's or bench_generation's) into one results file."""
    items = []
    for status in sorted(Path(logs).glob("*.status"), key=lambda p: [int(x) for x in p.stem.split(".")]):
        item_id, state, seconds, est, what = status.read_text().rstrip("\n").split("\t")
        log = Path(logs) / f"{item_id}.log"
        tail = log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []
        items.append({"id": item_id, "status": state, "seconds": int(seconds), "estimate_s": int(est), "what": what,
                      "command": (Path(logs) / f"{item_id}.cmd").read_text().strip()
                      if (Path(logs) / f"{item_id}.cmd").exists() else None,
                      "result": load_json(Path(logs) / f"{item_id}.json"), "tail": tail})
    Path(out).write_text(json.dumps({"part": part, "items": items}, indent=1) + "\n")
    return items

def brief(item):
    """One cell: the numbers an item is run for."""
    r = item["result"] or {}
    if "rows" in r:  # bench_generation
        return "; ".join(f"b{x['batch']} {x['method']} {x['decode_ms_per_step']} ms/step"
                         + (f" (same tokens: {x['same_greedy_tokens']})" if "same_greedy_tokens" in x else "")
                         for x in r["rows"])
    if "time/step_s" in r:  # gpu_check
        f = lambda k: "-" if r.get(k) is None else f"{r[k]:.1f}"
        saves = "saves ok" if r["save_checks"] and not r["save_problems"] else f"SAVE PROBLEMS: {r['save_problems'][:1]}"
        gen = r.get("generation") or ["-"]
        return (f"step {f('time/step_s')} s (gen {f('time/generate_s')}, rewards {f('time/rewards_s')}, lp+bw "
                f"{f('time/logprobs_and_backward_s')}, opt {f('time/optimizer_s')}), {f('peak_memory_gb')} GB, "
                f"util {r.get('gpu_util_median', '-')}%, {r.get('backend')}, {saves}; {gen[-1][:90]}")
    if r.get("failed"):
        return "; ".join(line for line in r["console_tail"].splitlines()[-3:])[:200]
    return (item["tail"] or [""])[-1][:200]

def fast_path(r):
    said = " | ".join(r.get("generation") or [])
    share = r.get("fast_path_share")  # generation/fast_path over the steps (None from an older gpu_check)
    ok = "fast (" in said and "unavailable" not in said and "failed" not in said and share in (None, 1.0)
    return "yes" if ok else f"no (fast_path {share}; {said[:160]})"

def targets(items):
    runs = [i["result"] for i in items if i["result"] and "time/step_s" in i["result"]]
    big = [r for r in runs if r["geometry"] == "20b" and r["time/step_s"]]
    bench = [(i["result"]["environment"], row) for i in items if i["result"] and "rows" in i["result"]
             for row in i["result"]["rows"]]
    print("\ntargets (issue 21: H100, 20B geometry, one group of 8):")
    for env, row in bench:
        if row["batch"] == 8 and row["method"] == "generation.generate" and env["geometry"] == "20b":
            ms = row["decode_ms_per_step"]
            print(f"  decode step, BF16 + LoRA, batch 8, {env['layers']} layers: {ms} ms (<= 10) "
                  f"{'PASS' if ms <= 10 and env['layers'] == 24 else 'FAIL' if ms > 10 else 'n/a: not 24 layers'}; "
                  f"same greedy tokens as model.generate: {row.get('same_greedy_tokens')}")
    # 4-bit against BF16, and BF16 on transformers against on Unsloth: rows alike in all else
    for same in sorted({(r["fast_generation"], r["max_completion_length"], r.get("layers") or 24) for r in big},
                       reverse=True):
        pick = {(r["preset"], r["backend"]): r for r in big
                if (r["fast_generation"], r["max_completion_length"], r.get("layers") or 24) == same}
        fast, tokens, layers = same
        on = f"fast generation {'on' if fast else 'off'}, {tokens} tokens" + (f", {layers} layers" * (layers != 24))
        four, bf16 = pick.get(("gpt-oss-20b", "unsloth")), pick.get(("gpt-oss-20b-bf16", "unsloth"))
        if four and bf16:
            a, b = four["time/step_s"], bf16["time/step_s"]
            print(f"  4-bit / BF16 step (Unsloth), {on}: {a:.1f} / {b:.1f} s = {a / b:.2f}x (<= 1.5) "
                  f"{'PASS' if a / b <= 1.5 else 'FAIL'}")
        other = pick.get(("gpt-oss-20b-bf16", "transformers"))
        if other and bf16:  # issue 21: the default may pick another route where it is faster
            print(f"  BF16 step on transformers + PEFT / on Unsloth, {on}: {other['time/step_s']:.1f} / "
                  f"{bf16['time/step_s']:.1f} s")
    alone = {row["method"]: (env, row) for env, row in bench
             if row["batch"] == 8 and env["geometry"] == "20b" and env["layers"] == 24}
    for r in big:  # generation alone from bench_generation (transformers + PEFT, BF16), the rest from the step split
        method = "generation.generate" if r["fast_generation"] else "model.generate"
        if r["preset"] != "gpt-oss-20b-bf16" or method not in alone or r.get("layers"):
            continue
        row = alone[method][1]
        generate = (row["prefill_ms"] + row["decode_ms_per_step"] * (r["max_completion_length"] - 1)) / 1000
        parts = generate + r["time/rewards_s"] + r["time/logprobs_and_backward_s"]
        ratio = r["time/step_s"] / parts
        print(f"  BF16 step on {r['backend']} / (generation alone + rewards + log-probs/backward), fast "
              f"{'on' if r['fast_generation'] else 'off'}, {r['max_completion_length']} tokens: "
              f"{r['time/step_s']:.1f} / {parts:.1f} s = {ratio:.2f}x (<= 1.3) {'PASS' if ratio <= 1.3 else 'FAIL'}; "
              f"in-step generate {r['time/generate_s']:.1f} s against {generate:.1f} s alone")
    for r in big:
        if r["fast_generation"]:
            print(f"  fast path taken, {r['preset']} on {r['backend']}, {r['max_completion_length']} tokens: "
                  f"{fast_path(r)}")
    for r in runs:  # the model each run trained: the default's split 4-bit experts, BF16's fused ones
        if r.get("backend") == "unsloth" and r.get("preset") in ("gpt-oss-20b", "gpt-oss-20b-bf16"):
            want = "split" if r["preset"] == "gpt-oss-20b" else "fused"
            said = r.get("experts") or "no model: line"
            print(f"  layout, {r['preset']} ({r['geometry']}, {r.get('max_completion_length')} tokens): {said} "
                  f"{'PASS' if f'experts {want}' in said else 'FAIL'}")
    # every training run that ran saves LoRA, and a merged copy on request: each save verified, or the run failed
    saves = [(i["id"], i["result"] or {}) for i in items if "gpu_check.py" in (i["command"] or "")
             and "--build_only" not in i["command"] and not i["status"].startswith("skipped")]
    bad = [s for s, r in saves if not r.get("save_checks") or r["save_problems"]
           or (r["save_method"] != "lora" and not any(f"final-{r['save_method']}" in c for c in r["save_checks"]))]
    methods = sorted({r["save_method"] for _, r in saves if "save_method" in r})
    if saves:
        print(f"  saves verified: {len(saves) - len(bad)} of {len(saves)} runs ({', '.join(methods)}) "
              f"{'PASS' if not bad else 'FAIL: ' + ', '.join(bad)}")
    for i in items:
        if "evaluate_2048" in (i["command"] or ""):
            print(f"  evaluate_2048 --adapter (an Unsloth adapter, fresh process) [{i['id']}]: {i['status']}")
        if "pytest" in (i["command"] or ""):
            print(f"  test suite [{i['id']}]: {i['status']}: {brief(i)}")

mode, args = sys.argv[1], sys.argv[2:]
if mode == "collect":
    items = collect(*args)
    print(f"\n| id | status | s (est) | what | result |\n|---|---|---|---|---|")
    for i in items:
        print(f"| {i['id']} | {i['status']} | {i['seconds']} ({i['estimate_s']}) | {i['what']} | {brief(i)} |")
else:
    items = [i for path in args for i in (load_json(path) or {"items": []})["items"]]
targets(items)
PY
}

if [ "$MODE" = summary ]; then
  (($#)) || usage
  summarise targets "$@"
  exit 0
fi
[ -n "$PART" ] || usage

# --- running items -----------------------------------------------------------------------------------------------

selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

step() {  # a setup command: printed, run, never fatal
  if [ "$MODE" = dry ]; then
    printf '%s  # [setup]\n' "$1"
    return 0
  fi
  echo "\$ $1"
  bash -c "$1" || echo "setup: exit $? from: $1"
}

note() {  # an item's status line, for the summary
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >"$LOGS/$1.status"
}

pack() {  # the item logs so far, under $OUT: whatever the call's end, they come back
  local tmp="$OUT/.logs.$BASHPID.tar.gz"
  tar -czf "$tmp" -C "$LOGS" . 2>/dev/null || true
  mv -f "$tmp" "$OUT/part$P-logs.tar.gz" || true
}

wait_bg() {  # the bg items still running (by pid: a bare `wait` would also wait for the console's tee)
  local pid
  for pid in "${BG[@]}"; do wait "$pid" || true; done
  BG=()
}

run_one() {  # ID EST HOW WHAT CMD KEEP AFTER: once AFTER has ended, run CMD under the part's deadline, log it
  local id=$1 est=$2 how=$3 what=$4 cmd=$5 keep=$6 after=$7 t0=$SECONDS rc=0 state f limit
  while [ -n "$after" ] && [ ! -f "$LOGS/$after.status" ] && ((SECONDS < DEADLINE)); do sleep 2; done
  limit=$((DEADLINE - SECONDS))
  if ((limit < 10)); then
    note "$id" "skipped: the part's time is up" 0 "$est" "$what"
    echo "[$id] skipped, the part's time is up: bash bench/gpu_matrix.sh $P --only $id"
    return 0
  fi
  echo "[$id] start (~${est}s, limit ${limit}s): $what"
  timeout -k 5 "$limit" bash -c "$cmd" >"$LOGS/$id.log" 2>&1 || rc=$?
  state=passed
  if ((rc == 124 || rc == 137)); then
    state="timed out at ${limit}s"
  elif ((rc != 0)); then
    state="failed (exit $rc)"
  fi
  if [ -n "$keep" ]; then
    for f in training.log console.txt metrics.jsonl results.json; do
      if [ -f "$keep/$f" ]; then cp "$keep/$f" "$LOGS/$id-$f"; fi
    done
  fi
  note "$id" "$state" "$((SECONDS - t0))" "$est" "$what"
  echo "[$id] $state in $((SECONDS - t0))s (est ${est}s): $what"
  if [[ $how == fg* ]]; then tail -n 20 "$LOGS/$id.log" | sed "s/^/  [$id] /"; fi
  pack
}

item() {  # ID EST HOW WHAT CMD [KEEP]
  # HOW: fg (alone on the machine), bg (beside other bg and side items), side (CPU only: beside fg items too);
  # +cpu: runs under --cpu too; @ID: starts once item ID has ended
  local id=$1 est=$2 how=$3 what=$4 cmd=$5 keep=${6:-} after=""
  selected "$id" || return 0
  if [[ $how == *@* ]] && selected "${how#*@}"; then after=${how#*@}; fi
  if [[ $how != fg* ]]; then  # its own Unsloth compile cache: items side by side never write one folder at once
    cmd="UNSLOTH_COMPILE_LOCATION=$WORK/unsloth-$id $cmd"
  fi
  if [ "$MODE" = dry ]; then
    printf '%s  # [%s ~%ss %s] %s\n' "$cmd" "$id" "$est" "$how" "$what"
    return 0
  fi
  echo "$cmd" >"$LOGS/$id.cmd"
  if [ "$MODE" = cpu ] && [[ $how != *cpu* ]]; then
    note "$id" "skipped: needs CUDA" 0 "$est" "$what"
    echo "[$id] skipped on the CPU (needs CUDA): $what"
    return 0
  fi
  if [ "$MODE" = gpu ] && ((GUARD && SECONDS + est > DEADLINE)); then
    note "$id" "skipped: ~${est}s left no room ($((DEADLINE - SECONDS))s left)" 0 "$est" "$what"
    echo "[$id] skipped, ~${est}s does not fit the $((DEADLINE - SECONDS))s left: bash bench/gpu_matrix.sh $P --only $id"
    return 0
  fi
  if [[ $how != fg* ]] && ((JOBS > 1)); then
    while (($(jobs -rp | wc -l) >= JOBS)); do sleep 1; done
    run_one "$id" "$est" "$how" "$what" "$cmd" "$keep" "$after" &
    if [[ $how == side* ]]; then SIDE+=("$!"); else BG+=("$!"); fi
  else
    wait_bg  # a fg item has the GPU to itself: its timings share it with nothing of ours
    run_one "$id" "$est" "$how" "$what" "$cmd" "$keep" "$after"
  fi
}

check() {  # the gpu_check command line: ARGS [-- TRAIN_2048 FLAGS]; --cpu goes before the -- under --cpu
  local args=$* cpu=""
  if [ "$MODE" = cpu ]; then cpu=" --cpu"; fi
  if [[ $args == *" -- "* ]]; then
    echo "$PY bench/gpu_check.py ${args%% -- *} --tokenizer_dir $TOK$cpu -- ${args#* -- }"
  else
    echo "$PY bench/gpu_check.py $args --tokenizer_dir $TOK$cpu"
  fi
}

# --- where the 20B geometry goes ---------------------------------------------------------------------------------

free_gib() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 { print int($4 / 1048576) }'; }

pick_big() {  # BIG (the 20B workdir), SCRATCH (the 16-bit split copy's), L20 (--layers N, empty for all 24): reused
  local dir name shm work room layers
  L20=""
  if [ -n "${BIG:-}" ]; then
    if [ -n "${LAYERS:-}" ] && ((LAYERS < 24)); then L20="--layers $LAYERS"; fi
    SCRATCH=${SCRATCH:-$WORK/scratch}
    return 0
  fi
  for dir in /dev/shm/gpu-matrix-20b "$WORK/20b"; do
    for name in "$dir"/gpt-oss-20b-*; do  # gpu_check's names: -all or -N layers (a .part is a build cut short)
      if [[ ${name##*-} =~ ^(all|[0-9]+)$ ]] && [ -f "$name/config.json" ]; then
        BIG=$dir
        if [ "$dir" = "$WORK/20b" ]; then SCRATCH=/dev/shm/gpu-matrix-scratch; else SCRATCH=$WORK/scratch; fi
        case ${name##*-} in all) ;; *) L20="--layers ${name##*-}" ;; esac
        echo "# 20B geometry: reusing $name"
        return 0
      fi
    done
  done
  if [ "$MODE" = dry ]; then BIG=/dev/shm/gpu-matrix-20b SCRATCH=$WORK/scratch; return 0; fi  # df decides there
  # 24 layers: 39 GiB of bf16 (1.53 GiB a layer, 2.2 GiB of embeddings), its split 4-bit copy ~12 GiB (0.45 a layer,
  # 16-bit embeddings), 2 GiB to spare; the 16-bit split copy on the way (as big as the model) goes to the other place
  shm=$(free_gib /dev/shm || true); shm=${shm:-0}
  mkdir -p "$WORK"; work=$(free_gib "$WORK" || true); work=${work:-0}
  if ((shm >= 54)); then BIG=/dev/shm/gpu-matrix-20b room=$shm SCRATCH=$WORK/scratch
  elif ((work >= 54)); then BIG=$WORK/20b room=$work SCRATCH=/dev/shm/gpu-matrix-scratch
  else
    if ((shm >= work)); then BIG=/dev/shm/gpu-matrix-20b room=$shm SCRATCH=$WORK/scratch
    else BIG=$WORK/20b room=$work SCRATCH=/dev/shm/gpu-matrix-scratch; fi
    layers=$(((room * 100 - 620) / 198 / 2 * 2))
    ((layers >= 2)) || layers=2
    L20="--layers $layers"
    echo "# 20B geometry: ${room} GiB free at most (/dev/shm ${shm}, $WORK ${work}): $layers of 24 layers"
  fi
  echo "# 20B geometry in $BIG (${room} GiB free) ${L20:-all 24 layers}"
}

setup() {
  step "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  if [ "$MODE" != cpu ]; then
    if [ -f .gpu-wheels/install.sh ] || [ "$MODE" = dry ]; then
      step "bash .gpu-wheels/install.sh .gpu-wheels"
    else
      echo "setup: no .gpu-wheels here (carry it): unsloth, trl, bitsandbytes... may be missing"
    fi
  fi
  if [ -f .gpu-tokenizer.tar.gz ] || [ "$MODE" = dry ]; then
    step "mkdir -p $WORK && tar -xzf .gpu-tokenizer.tar.gz -C $WORK"
  else
    echo "setup: no .gpu-tokenizer.tar.gz here (carry it): gpu_check will refuse --tokenizer_dir $TOK"
  fi
  step "$PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))'"
  step "$PY -m pip list 2>/dev/null | grep -iE '^(torch|transformers|trl|peft|accelerate|unsloth|unsloth.zoo|bitsandbytes|datasets|triton|pytest) '"
  if [ "$MODE" != cpu ]; then
    step "nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv"
  fi
  step "df -h /dev/shm /tmp . | cat; nproc; free -g | head -2"
}

# --- the parts ---------------------------------------------------------------------------------------------------
# Value first: the fast path at the 20B geometry (part 1), the same without it (2), the decode step alone and every
# correctness check (3), then BF16 on the transformers backend and the presets' own 1024-token budget (4, 5). Parts
# 1-3 fill one session's 30 minutes; 4, 4's leftovers and 5 another's.
# The 20B rows of parts 1-2 use 200 completion tokens: what the one earlier H100 run used (the before of PERF.md), and
# 3 steps at 1024 cost ~330 s (BF16) to ~545 s (4-bit) apiece; parts 4-5 run the 1024 budget.

part1() {  # first what the CPU cannot check (Unsloth's loader, get_peft_model and merge on the default's split 4-bit
  # layout: tests/unsloth stands in for them), then the fast path at the 20B geometry, 200 tokens: 4-bit and BF16
  pick_big
  item 1.0 90 fg "tiny default preset on its own layout (split 4-bit): Unsloth's from_pretrained, get_peft_model, a step, its merge checked" \
    "$(check --geometry tiny --steps 2 --preset gpt-oss-20b --workdir $WORK/run-1.0 --save_method merged_16bit \
      --json "$LOGS/1.0.json" -- --max_completion_length $TINY_TOKENS --fast_generation true)" "$WORK/run-1.0/run"
  item 1.1 240 fg "build the 20B geometry in $BIG: random BF16 (~42 GB) and its split 4-bit copy (~12 GB)" \
    "$(check --geometry 20b $L20 --workdir "$BIG" --scratch "$SCRATCH" --build_only)"
  item 1.3 270 fg "20B 4-bit default preset (split 4-bit layout), fast generation on, 200 tokens, 3 steps" \
    "$(check --geometry 20b $L20 --preset gpt-oss-20b --workdir "$BIG" --steps 3 --json "$LOGS/1.3.json" \
      -- --max_completion_length 200 --fast_generation true)" "$BIG/run"
  item 1.2 200 fg "20B BF16 preset, fast generation on, 200 tokens, 3 steps" \
    "$(check --geometry 20b $L20 --preset gpt-oss-20b-bf16 --workdir "$BIG" --steps 3 --json "$LOGS/1.2.json" \
      -- --max_completion_length 200 --fast_generation true)" "$BIG/run"
}

part2() {  # the same without the fast path: the before (the last H100 run: 19.5 s BF16, 33 s 4-bit)
  pick_big
  item 2.1 60 fg "build the 20B geometry and its split 4-bit copy (reused when the machine stayed warm)" \
    "$(check --geometry 20b $L20 --workdir "$BIG" --scratch "$SCRATCH" --build_only)"
  item 2.2 170 fg "20B BF16 preset, fast generation off, 200 tokens, 3 steps" \
    "$(check --geometry 20b $L20 --preset gpt-oss-20b-bf16 --workdir "$BIG" --steps 3 --json "$LOGS/2.2.json" \
      -- --max_completion_length 200 --fast_generation false)" "$BIG/run"
  item 2.3 240 fg "20B 4-bit default preset, fast generation off, 200 tokens, 3 steps" \
    "$(check --geometry 20b $L20 --preset gpt-oss-20b --workdir "$BIG" --steps 3 --json "$LOGS/2.3.json" \
      -- --max_completion_length 200 --fast_generation false)" "$BIG/run"
}

part3() {  # correctness: the tests, the tiny matrix, the saves, evaluate_2048 (side by side); then the decode step
  # alone on the GPU (the suite, CPU only, may still be running beside it: it needs ~400 s, so it starts first)
  local t=$WORK/run- tiny="--geometry tiny --steps 3" ev=$WORK/eval-3.10
  item 3.1 400 side "the test suite with the GPU set installed" \
    "timeout 550 $PY -m pytest -q -p no:cacheprovider"
  item 3.2 80 bg+cpu "tiny, default preset (Unsloth 4-bit), fast off, save lora (the adapter 3.10 evaluates)" \
    "$(check $tiny --preset gpt-oss-20b --workdir ${t}3.2 --json "$LOGS/3.2.json" \
      -- --max_completion_length $TINY_TOKENS --fast_generation false)" "${t}3.2/run"
  item 3.3 90 bg+cpu "tiny, default preset (Unsloth 4-bit), fast on, save merged_16bit" \
    "$(check $tiny --preset gpt-oss-20b --workdir ${t}3.3 --save_method merged_16bit --json "$LOGS/3.3.json" \
      -- --max_completion_length $TINY_TOKENS --fast_generation true)" "${t}3.3/run"
  item 3.4 80 bg+cpu "tiny, BF16 preset (Unsloth), fast off, save lora" \
    "$(check $tiny --preset gpt-oss-20b-bf16 --workdir ${t}3.4 --json "$LOGS/3.4.json" \
      -- --max_completion_length $TINY_TOKENS --fast_generation false)" "${t}3.4/run"
  item 3.5 90 bg+cpu "tiny, BF16 preset (Unsloth), fast on, save merged_16bit" \
    "$(check $tiny --preset gpt-oss-20b-bf16 --workdir ${t}3.5 --save_method merged_16bit --json "$LOGS/3.5.json" \
      -- --max_completion_length $TINY_TOKENS --fast_generation true)" "${t}3.5/run"
  item 3.6 70 bg+cpu "tiny, --backend transformers (BF16 + PEFT), fast off, save lora" \
    "$(check $tiny --preset gpt-oss-20b-bf16 --workdir ${t}3.6 --json "$LOGS/3.6.json" \
      -- --max_completion_length $TINY_TOKENS --fast_generation false --backend transformers)" "${t}3.6/run"
  item 3.7 80 bg+cpu "tiny, --backend transformers (BF16 + PEFT), fast on, save merged_16bit" \
    "$(check $tiny --preset gpt-oss-20b-bf16 --workdir ${t}3.7 --save_method merged_16bit --json "$LOGS/3.7.json" \
      -- --max_completion_length $TINY_TOKENS --fast_generation true --backend transformers)" "${t}3.7/run"
  item 3.8 110 bg "2 layers of the 20B geometry, default preset (4-bit), save merged_16bit (unsloth-zoo 885)" \
    "$(check --geometry 20b --layers 2 --steps 2 --preset gpt-oss-20b --workdir ${t}3.8 --save_method merged_16bit \
      --json "$LOGS/3.8.json" -- --max_completion_length 64)" "${t}3.8/run"
  item 3.9 30 bg "--save_method mxfp4 refused at startup: one line naming llm-compressor, exit status 2" \
    "$PY train_2048.py --save_method mxfp4 --output_dir $WORK/mxfp4 > $WORK/mxfp4.txt 2>&1; test \$? -eq 2 && grep -q llm-compressor $WORK/mxfp4.txt && cat $WORK/mxfp4.txt"
  item 3.10 60 bg+cpu@3.2 "evaluate_2048.py on 3.2's Unsloth adapter, in a fresh process" \
    "$PY evaluate_2048.py --adapter ${t}3.2/run/final --model ${t}3.2/gpt-oss-tiny-all --samples 2 --games 2 --output_dir $ev$EVAL_EXTRA" \
    "$ev"
  item 3.11 150 fg "decode step alone: 20B geometry, BF16 + LoRA, batch 8, model.generate against ours" \
    "$PY bench/bench_generation.py --geometry 20b --lora --batch 8 --new_tokens 100 --prompt_tokens 300 --repeats 3 --json $LOGS/3.11.json"
}

part4() {  # BF16 off Unsloth (issue 21: the default may take a faster route), then the BF16 preset at its own
  # budget (1024 tokens). 4.4 and 4.5 rarely fit after them: `--only 4.4,4.5` is a call of its own (~550 s).
  pick_big
  item 4.1 60 fg "build the 20B geometry and its split 4-bit copy (reused when the machine stayed warm)" \
    "$(check --geometry 20b $L20 --workdir "$BIG" --scratch "$SCRATCH" --build_only)"
  item 4.2 200 fg "20B BF16 preset on --backend transformers (PEFT), fast generation on, 200 tokens, 3 steps" \
    "$(check --geometry 20b $L20 --preset gpt-oss-20b-bf16 --workdir "$BIG" --steps 3 --json "$LOGS/4.2.json" \
      -- --max_completion_length 200 --fast_generation true --backend transformers)" "$BIG/run"
  item 4.3 300 fg "20B BF16 preset, fast generation on, its 1024 tokens, 3 steps" \
    "$(check --geometry 20b $L20 --preset gpt-oss-20b-bf16 --workdir "$BIG" --steps 3 --json "$LOGS/4.3.json" \
      -- --fast_generation true)" "$BIG/run"
  item 4.4 130 fg "decode step alone at batch 16 (the wide preset's group), ours only" \
    "$PY bench/bench_generation.py --geometry 20b --lora --batch 16 --new_tokens 100 --prompt_tokens 300 --repeats 3 --no_baseline --json $LOGS/4.4.json"
  item 4.5 330 fg "20B BF16 preset, fast generation off, its 1024 tokens, 3 steps" \
    "$(check --geometry 20b $L20 --preset gpt-oss-20b-bf16 --workdir "$BIG" --steps 3 --json "$LOGS/4.5.json" \
      -- --fast_generation false)" "$BIG/run"
}

part5() {  # the 4-bit default at its own budget (1024 tokens). Fast generation off would take ~540 s for 3 steps,
  # ~630 s with setup and build: more than a call; its row is 2.3, at 200 tokens.
  pick_big
  item 5.1 60 fg "build the 20B geometry and its split 4-bit copy (reused when the machine stayed warm)" \
    "$(check --geometry 20b $L20 --workdir "$BIG" --scratch "$SCRATCH" --build_only)"
  item 5.2 420 fg "20B 4-bit default preset, fast generation on, its 1024 tokens, 3 steps" \
    "$(check --geometry 20b $L20 --preset gpt-oss-20b --workdir "$BIG" --steps 3 --json "$LOGS/5.2.json" \
      -- --fast_generation true)" "$BIG/run"
  item 5.3 270 fg "20B 4-bit default, LoRA on attention only (no expert LoRA: Unsloth's grouped 4-bit expert kernel), fast on, 200 tokens" \
    "$(check --geometry 20b $L20 --preset gpt-oss-20b --workdir "$BIG" --steps 3 --json "$LOGS/5.3.json" \
      -- --max_completion_length 200 --fast_generation true --lora_target_modules q_proj k_proj v_proj o_proj)" "$BIG/run"
}

run_part() {
  P=$1 BG=() SIDE=()
  LOGS=$WORK/logs-part$P
  if [ "$MODE" = dry ]; then
    echo "# part $P"
    setup
    "part$P"
    return 0
  fi
  local t0=$SECONDS tee left
  DEADLINE=$((SECONDS + BUDGET_S))
  rm -rf "$LOGS"; mkdir -p "$LOGS" "$OUT"
  exec > >(tee -a "$OUT/part$P.log" >&3) 2>&1
  tee=$!
  echo "== gpu_matrix part $P ($MODE), $(date -u +%FT%TZ), budget ${BUDGET_S}s, logs $OUT"
  setup
  "part$P"
  BG+=("${SIDE[@]}")
  wait_bg
  echo "== part $P done in $((SECONDS - t0))s"
  summarise collect "$LOGS" "$P" "$OUT/part$P-results.json" || echo "summary failed (exit $?)"
  # shellcheck disable=SC2016  # awk's own fields
  left=$(printf '%s\n' "$LOGS"/*.status | sort -V | xargs awk -F '\t' \
    '$2 ~ /^skipped: [~t]/ { printf "%s%s", sep, $1; sep = "," }' 2>/dev/null || true)
  if [ -n "$left" ]; then echo "left over, for a call of their own: bash bench/gpu_matrix.sh $P --only $left"; fi
  pack
  exec >&3 2>&4
  wait "$tee" 2>/dev/null || true  # the console's last lines are in partN.log before the call ends
}

exec 3>&1 4>&2

if [ "$PART" = all ]; then
  for p in 1 2 3 4 5; do run_part "$p"; done
else
  run_part "$PART"
fi
