#!/usr/bin/env bash
# One lent GPU's measurements, prepared to fit a short lease (about 9 minutes on one
# H200 for `measure`, 4 for `profile`). Writes under $OUT (default ./gpu_out):
#
#   bash benchmarks/gpu_session.sh measure   # each mode against plain jax.jit, both models
#   bash benchmarks/gpu_session.sh profile   # the Llama-style step profiled: kernel tables,
#                                            # modeled schedules, the calibrated model
#
# `measure` is the check of "no mode slower than jax.jit on one GPU"; `profile` is the
# check of the calibrated model (and names, per kernel, where a mode's time goes:
# `calibration_gaps` in the log, the tables in prof.tgz).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
GPU=${GPU:-h200}
quiet() { grep --line-buffered -v "cuda_\|absl::\|^WARNING: All log\|^I0000\|^W0000\|^E0000"; }
log() { tee -a "$OUT/log.txt"; }
{ date; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
  python3 -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__)"
} 2>&1 | log
MODES=replicated,gspmd_zero1,jaxsync_ddp,jaxsync_ddp_cast,jaxsync_zero,jaxsync_fsdp
case "${1:-measure}" in
  measure)
    for model in llama gpt; do
      echo "== $model $(date +%T)" | log
      timeout 280 python3 benchmarks/bench_gpu_real.py --model "$model" --defaults-only \
        --gpu "$GPU" --target= --only "$MODES" --out "$OUT/$model.md" 2>&1 | quiet | log
    done ;;
  profile)
    echo "== profile $(date +%T)" | log
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 280 python3 benchmarks/bench_gpu_real.py \
      --model llama --gpu "$GPU" --target= --profile "$OUT/prof" \
      --only replicated,gspmd_zero1,jaxsync_zero,jaxsync_fsdp --out "$OUT/cal.md" 2>&1 | quiet | log
    tar czf "$OUT/prof.tgz" -C "$OUT" prof && rm -rf "$OUT/prof" ;;
  *) echo "usage: $0 measure|profile" >&2; exit 2 ;;
esac
echo "== done $(date +%T)" | log
