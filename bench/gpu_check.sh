#!/usr/bin/env bash
# The GPU path, proven in one command (issue 16): Triton kernels compiled for the GPU against the float64
# reference, the SGMV bench against HBM bandwidth, the bf16 runner and engine against transformers/PEFT,
# and a fleet run against PEFT's generate — each step with its own log and JSON under $OUT, then
# $OUT/summary.json and one verdict. Under 12 minutes on an H200 before the two Gemma steps (not yet timed there).
#
#   bash bench/gpu_check.sh                    # on the GPU machine: python3 from PATH (or $PYTHON)
#   bash bench/gpu_check.sh --cpu-rehearsal    # here, on CPU: the same steps on tiny shapes, with the
#                                              # project venv's python, Triton under TRITON_INTERPRET=1
#   make gpu-check                             # the first
#
# Options: --strict-goals (a missed performance goal fails the run too), --only STEP[,STEP] (kernels,
# gpu_kernels, parity, parity_qwen3, parity_phi3, parity_gemma2, parity_gemma3, fleet). parity_qwen3 is parity on a
# Qwen3 (q/k norms, head_dim 128 beside Qwen3-8B's hidden, GQA; tiny: head_dim 24), parity_phi3 on a Phi-3 (fused
# qkv_proj and gate_up_proj in the checkpoint and in the PEFT adapters; Llama-2-7B's shapes), parity_gemma2 and
# parity_gemma3 on Gemma-2-9B- and Gemma-3-4B-shaped layers with every Gemma feature on (soft-capping, sliding layers
# with a window shorter than the prompts, query_pre_attn_scalar, Gemma 3's q/k norms and two RoPE bases; the runner's
# torch path for Gemma's small ops and its soft-capped attention; bench/gpu/models.py GEMMA_SHAPES). Environment: OUT (default var/gpu_check), PYTHON, LORAFLEET_GPU_WORK
# (scratch for models and adapters; default a fresh folder under /tmp, removed at the end).
# Runs from the source tree (PYTHONPATH = the repository root); needs torch, triton, transformers, peft,
# safetensors, tokenizers and numpy — no Django, no database, no network. Every step runs even when an
# earlier one failed; the exit status is non-zero when any step failed (a mismatch, a crash, a timeout).
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE=gpu
STRICT=()
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-rehearsal) MODE=rehearsal ;;
        --strict-goals) STRICT=(--strict-goals) ;;
        --only) shift; ONLY=",${1:-},"; ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

if [ "$MODE" = rehearsal ]; then
    PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
    export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"  # shared CPUs: no spinning OpenMP threads
else
    PYTHON="${PYTHON:-python3}"
fi
command -v "$PYTHON" >/dev/null 2>&1 || { echo "no python at '$PYTHON' (set PYTHON)" >&2; exit 2; }
OUT="${OUT:-$REPO/var/gpu_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset DJANGO_SETTINGS_MODULE
if [ -n "${LORAFLEET_GPU_WORK:-}" ]; then
    WORK="$LORAFLEET_GPU_WORK"
    mkdir -p "$WORK"
else
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/lorafleet-gpu-check.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
fi
# Triton caches compiled kernels under ~/.triton; a machine whose home is not writable gets a scratch cache
if [ -z "${TRITON_CACHE_DIR:-}" ] && ! { mkdir -p "${HOME:-/nonexistent}/.triton" && [ -w "$HOME/.triton" ]; } 2>/dev/null; then
    export TRITON_CACHE_DIR="$WORK/triton-cache"
fi
cd "$REPO"

rm -f "$OUT"/{kernels,gpu_kernels,parity,parity_qwen3,parity_phi3,parity_gemma2,parity_gemma3,fleet,summary}.{json,log} "$OUT/steps.tsv" "$OUT/machine.txt"
{
    echo "mode: $MODE"; date; uname -a; "$PYTHON" --version
    "$PYTHON" -c 'import torch, triton, transformers, peft; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())' 2>&1
    command -v nvidia-smi >/dev/null && nvidia-smi 2>&1
} > "$OUT/machine.txt" 2>&1
echo "gpu_check ($MODE): python $PYTHON, figures and logs in $OUT"

now_ns() { date +%s%N; }
secs_since() { local d=$(( $(now_ns) - $1 )); printf '%d.%03d' $((d / 1000000000)) $(((d / 1000000) % 1000)); }
T0=$(now_ns)
# step NAME TIMEOUT_S INTERPRET(0|1) COMMAND...
step() {
    local name="$1" limit="$2" interpret="$3"
    shift 3
    if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then return; fi
    local t0 rc
    t0=$(now_ns)
    if [ "$interpret" = 1 ]; then
        env TRITON_INTERPRET=1 timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    else  # compiled kernels: TRITON_INTERPRET must not leak in from the caller's environment
        env -u TRITON_INTERPRET timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    fi
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(secs_since "$t0")" "$limit" >> "$OUT/steps.tsv"
    if grep -q "^STEP $name:" "$OUT/$name.log"; then
        grep "^STEP $name:" "$OUT/$name.log" | tail -1
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "STEP $name: FAIL — timed out after $limit s (see $name.log)"
    else
        echo "STEP $name: FAIL — exited $rc without a verdict (see $name.log)"
    fi
    if [ "$rc" != 0 ]; then tail -n 15 "$OUT/$name.log" | sed 's/^/    | /'; fi
}

COMMON=(--out "$OUT" --work "$WORK")
if [ "$MODE" = rehearsal ]; then
    step kernels 120 1 "$PYTHON" bench/gpu/check_kernels.py --rehearsal "${COMMON[@]}"
    step gpu_kernels 120 1 "$PYTHON" bench/gpu_kernels.py --smoke --out "$OUT"
    step parity 120 0 "$PYTHON" bench/gpu/check_parity.py --rehearsal "${COMMON[@]}"
    step parity_qwen3 120 0 "$PYTHON" bench/gpu/check_parity.py --rehearsal --arch qwen3 "${COMMON[@]}"
    step parity_phi3 120 0 "$PYTHON" bench/gpu/check_parity.py --rehearsal --arch phi3 "${COMMON[@]}"
    step parity_gemma2 120 0 "$PYTHON" bench/gpu/check_parity.py --rehearsal --arch gemma2 "${COMMON[@]}"
    step parity_gemma3 120 0 "$PYTHON" bench/gpu/check_parity.py --rehearsal --arch gemma3 "${COMMON[@]}"
    step fleet 120 0 "$PYTHON" bench/gpu/check_fleet.py --rehearsal "${COMMON[@]}"
else
    # Step limits add up to 16 minutes at the very worst (120 + 80 + 135 + 120 + 120 + 120 + 120 + 145 s); a sound run
    # is shorter. --only picks steps (e.g. --only parity_gemma2,parity_gemma3 where device time is short).
    # The kernels step compiles every Triton variant first (later steps find them in Triton's cache).
    step kernels 120 0 "$PYTHON" bench/gpu/check_kernels.py "${COMMON[@]}"
    step gpu_kernels 80 0 "$PYTHON" bench/gpu_kernels.py --out "$OUT"
    step parity 135 0 "$PYTHON" bench/gpu/check_parity.py "${COMMON[@]}"
    step parity_qwen3 120 0 "$PYTHON" bench/gpu/check_parity.py --arch qwen3 "${COMMON[@]}"
    step parity_phi3 120 0 "$PYTHON" bench/gpu/check_parity.py --arch phi3 "${COMMON[@]}"
    step parity_gemma2 120 0 "$PYTHON" bench/gpu/check_parity.py --arch gemma2 "${COMMON[@]}"
    step parity_gemma3 120 0 "$PYTHON" bench/gpu/check_parity.py --arch gemma3 "${COMMON[@]}"
    step fleet 145 0 "$PYTHON" bench/gpu/check_fleet.py "${COMMON[@]}"
fi

"$PYTHON" bench/gpu/summarize.py --out "$OUT" --mode "$MODE" --wall "$(secs_since "$T0")" ${STRICT[@]+"${STRICT[@]}"}
