#!/usr/bin/env bash
# The learner benchmark on one GPU: bench_learner.py in bfloat16 (float32 master weights and Adam state), each run in
# its own process with a time limit, results as JSON in $OUT (default ./gpu_learner). Needs jax[cuda] (and tokamax
# for its MoE path; the `gpu` extra has both) and a CUDA torch for the comparison, nothing from a hub; MFU against
# the bf16 dense peak of the device (989 TFLOP/s for an H100/H200; --peak_tflops overrides).
#
# RUNS picks what runs (default "paths", at most 8 minutes):
#   paths   every MoE path in MOE_PATHS (default "tokamax blocked ragged dense") on the same 0.9B model, ipa_jax
#           alone; fits an H100's 80 GB. megablox is TPU-only (elsewhere Pallas' interpreter). dense does 8x the
#           experts' work and may run out of memory: a run that fails is reported and the next one runs.
#   large   the 4.5B step (needs an H200's 141 GB), moe_impl auto
#   medium  the 0.9B step against torch on the same GPU, moe_impl auto
#
#   bash experiments/benchmarks/gpu_learner.sh                        # MFU of every MoE path
#   bash experiments/benchmarks/gpu_learner.sh --remat=matmuls        # extra flags go to every run (last one wins)
#   MOE_PATHS="tokamax blocked" bash experiments/benchmarks/gpu_learner.sh --moe_block_rows=2048
#   RUNS="large medium" bash experiments/benchmarks/gpu_learner.sh --moe_impl=blocked
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
    echo "== $name: $* ${extra[*]}"
    rm -f "$out/$name.json"
    timeout "$limit" "$python" experiments/benchmarks/bench_learner.py --dtype=bfloat16 --iters=3 \
        --out="$out/$name.json" "$@" "${extra[@]}" > "$out/$name.log" 2>&1
    echo "   exit $? -> $out/$name.json"
    grep -E '"(mfu|seconds_min|torch_time_over_ipa_jax_time)"' "$out/$name.json" 2>/dev/null || tail -3 "$out/$name.log"
}

# ~0.9B parameters (16 layers, hidden 1024, 32 experts top-4), 8 x 2048 tokens.
medium=(--layers=16 --hidden=1024 --heads=8 --experts=32 --top_k=4 --moe_width=512 --vocab=32768 --batch=8 --seq_len=2048)
moe_paths=${MOE_PATHS:-tokamax blocked ragged dense}
for what in ${RUNS:-paths}; do
    case $what in
    paths)
        for path in $moe_paths; do
            run "moe_$path" 120 "${medium[@]}" --moe_impl="$path" --torch_device=none --nonll_step --scan_layers
        done
        echo "== MFU of each MoE path (ipa_jax step)"
        for path in $moe_paths; do
            mfu=$(grep -m1 -oE '"mfu": [0-9.e-]+' "$out/moe_$path.json" 2>/dev/null | cut -d' ' -f2)
            echo "   $path: ${mfu:-no result ($out/moe_$path.log)}"
        done
        ;;
    # ~4.5B parameters (24 layers, hidden 2048, 32 experts top-8, Qwen3's vocabulary), 4 x 4096 tokens, ipa_jax
    # alone (two copies of the state would not fit), scanned layers with full remat.
    large)
        run large 250 --layers=24 --hidden=2048 --heads=16 --experts=32 --top_k=8 --moe_width=768 --vocab=151936 \
            --batch=4 --seq_len=4096 --torch_device=none --nonll_step --scan_layers --remat=full ;;
    medium) run medium 300 "${medium[@]}" --torch_device=cuda ;;
    *) echo "unknown run $what (RUNS: paths, large, medium)" >&2; exit 2 ;;
    esac
done
