#!/usr/bin/env bash
# The learner benchmark on one GPU in a few minutes: bench_learner.py in bfloat16 (float32 master weights and Adam
# state) on two Qwen3-MoE sizes, each in its own process with a time limit, results as JSON in $OUT (default
# ./gpu_learner). Needs jax[cuda] and a CUDA torch (the comparison), nothing from a hub; MFU against the bf16 dense
# peak of the device (989 TFLOP/s for an H100/H200; --peak_tflops overrides).
#
#   bash experiments/benchmarks/gpu_learner.sh                      # at most 9 minutes (the two time limits)
#   bash experiments/benchmarks/gpu_learner.sh --moe_impl=ragged    # extra flags go to every run
#   bash experiments/benchmarks/gpu_learner.sh --moe_block_rows=2048   # the blocked MoE's rows per block (0 = auto)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu_learner}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# torch shares the device in the same process: JAX allocates as it goes instead of taking 75% up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python=${PYTHON:-python3}
extra=("$@")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1

run() {  # name timeout_s flags...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$python" experiments/benchmarks/bench_learner.py --dtype=bfloat16 --iters=3 \
        --out="$out/$name.json" "$@" "${extra[@]}" > "$out/$name.log" 2>&1
    echo "   exit $? -> $out/$name.json"
    grep -E '"(mfu|seconds_min|torch_time_over_ipa_jax_time)"' "$out/$name.json" 2>/dev/null || tail -3 "$out/$name.log"
}

# ~4.5B parameters (24 layers, hidden 2048, 32 experts top-8, Qwen3's vocabulary), 4 x 4096 tokens, ipa_jax alone
# (two copies of the state would not fit), scanned layers with full remat.
run large 250 --layers=24 --hidden=2048 --heads=16 --experts=32 --top_k=8 --moe_width=768 --vocab=151936 \
    --batch=4 --seq_len=4096 --torch_device=none --nonll_step --scan_layers --remat=full
# ~0.9B parameters (16 layers, hidden 1024, 32 experts top-4), 8 x 2048 tokens, against torch on the same GPU.
run medium 300 --layers=16 --hidden=1024 --heads=8 --experts=32 --top_k=4 --moe_width=512 --vocab=32768 \
    --batch=8 --seq_len=2048 --torch_device=cuda
