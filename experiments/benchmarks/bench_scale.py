"""Scale on paper: the sharded train step of Qwen3-30B-A3B / Qwen3-235B-A22B, compiled ahead of time from abstract
shapes on a virtual mesh of fake CPU devices; per-device memory and FLOPs per step. No weight is allocated.

The step is the package's own (`ipa_jax.train.train_step`, jitted with TrainStep's shardings: state donated,
batch over the data-like mesh axes): FlashREINFORCE objective, AdamW, master weights in --param_dtype, compute in
--dtype. Parameters and optimizer state per device are exact (from the parameter shardings); activations and
workspace are XLA's temp buffers (`compiled.memory_analysis()`), FLOPs `compiled.cost_analysis()` per device
next to the analytic 6 * N_active + attention count (train/metrics.py).

Compiled for CPU, the MoE and attention paths are what a CPU would run unless forced: --moe_impl=ragged
(the GPU/TPU default) is lowered on CPU to a masked dense product over all experts, which overstates temp memory
and FLOPs by up to E; the default --moe_impl=blocked is close to the grouped GEMM's FLOPs. Attention compiles to
the causal-block path (cuDNN flash attention on a GPU holds less).

  python experiments/benchmarks/bench_scale.py --model=qwen3_30b_a3b --devices=8 --fsdp=2 --expert=4
  python experiments/benchmarks/bench_scale.py --model=qwen3_235b_a22b --devices=64 --fsdp=8 --expert=8
  python experiments/benchmarks/bench_scale.py --compile_time --layers=4,48   # scanned vs unrolled compile time

On a GPU node the same script with --platform=gpu (no fake devices) compiles for the real devices
(--moe_impl=auto picks ragged, attention cuDNN): e.g. on 8 H200s
  python experiments/benchmarks/bench_scale.py --platform=gpu --model=qwen3_30b_a3b --fsdp=2 --expert=4 \
      --moe_impl=auto --batch=8 --seq_len=4096
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags

from ipa_jax.host_memory import keep_freed_host_memory

flags.DEFINE_enum("model", "qwen3_30b_a3b", ["qwen3_30b_a3b", "qwen3_235b_a22b"], "HF architecture")
flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu", "tpu"], "cpu: a virtual mesh of --devices fake CPU devices")
flags.DEFINE_integer("devices", 8, "fake CPU devices (platform cpu)")
flags.DEFINE_integer("fsdp", 2, "mesh fsdp axis (batch and model width)")
flags.DEFINE_integer("expert", 4, "mesh expert axis (experts, and the batch)")
flags.DEFINE_integer("tensor", 1, "mesh tensor axis (heads, MLP width, vocab)")
flags.DEFINE_integer("batch", 8, "trajectories per step (global)")
flags.DEFINE_integer("seq_len", 4096, "tokens per trajectory")
flags.DEFINE_integer("microbatches", 1, "gradient-accumulation microbatches")
flags.DEFINE_string("moe_impl", "blocked", "auto | blocked | ragged | dense (see the module docstring)")
flags.DEFINE_string("remat", "full", "per-layer rematerialisation: none | full | dots | dots_no_batch")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "compute dtype")
flags.DEFINE_enum("param_dtype", "float32", ["bfloat16", "float32"], "master weights and optimizer state")
flags.DEFINE_bool("compile_time", False, "instead: compile seconds of a small MoE at --layers, scanned vs unrolled")
flags.DEFINE_list("layers", ["4", "48"], "depths for --compile_time")
flags.DEFINE_string("out", "", "also write the results as JSON here")
FLAGS = flags.FLAGS

# config.json of the Hugging Face checkpoints (fields that matter for the computation).
HF_CONFIGS = {
    "qwen3_30b_a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    "qwen3_235b_a22b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
}
# The README benchmark model (bench_model.py / bench_learner.py), for --compile_time.
SMALL_MOE = dict(
    model_type="qwen3_moe",
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=1024,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
)
GIB = 1024**3


def abstract_state(config, mesh, tx, param_dtype):
    """TrainState of ShapeDtypeStructs carrying their shardings (what TrainState.create would place), built from
    nnx.eval_shape: nothing is allocated."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ipa_jax.models import param_shardings
    from ipa_jax.models.qwen3 import Qwen3ForCausalLM
    from ipa_jax.train import TrainState

    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, dtype=param_dtype, rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    params = jax.tree.map(
        lambda v, s: v.replace(value=jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        params,
        param_shardings(params, mesh),
        is_leaf=is_var,
    )
    replicated = NamedSharding(mesh, P())
    # As TrainState.create: each parameter's Adam moments in its sharding, the rest replicated.
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, p: p.sharding, opt_shapes, params, transform_non_params=lambda _: replicated
    )
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt_shapes, opt_shardings)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    return TrainState(
        graphdef=graphdef,
        tx=tx,
        params=params,
        rest=rest,
        opt_state=opt_state,
        step=scalar,
        skipped=scalar,
        rng=rng,
        rl_start=scalar,
    )


def abstract_batch(batch: int, seq_len: int, sharding_of):
    """TrajectoryBatch of ShapeDtypeStructs; sharding_of(ndim) -> the batch sharding of a [B, ...] array."""
    import jax
    import jax.numpy as jnp

    from ipa_jax.trajectory import TrajectoryBatch

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_of(len(shape)))

    rows, per_row = (batch, seq_len), (batch,)
    return TrajectoryBatch(
        tokens=sds(rows, jnp.int32),
        attention_mask=sds(rows, bool),
        positions=sds(rows, jnp.int32),
        action_mask=sds(rows, bool),
        behavior_logprobs=sds(rows, jnp.float32),
        chunk_ids=sds(rows, jnp.int32),
        expert_mask=sds(rows, bool),
        rewards=sds(per_row, jnp.float32),
        group_ids=sds(per_row, jnp.int32),
        policy_versions=sds(per_row, jnp.int32),
    )


def compile_train_step(config, mesh, *, batch: int, seq_len: int, microbatches: int, dtype: str, param_dtype: str):
    """(compiled train step, abstract state, seconds to lower, seconds to compile) for the mesh."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ipa_jax.models import batch_sharding
    from ipa_jax.objectives import flash_reinforce_config
    from ipa_jax.train import OptimizerConfig, StepOptions, make_optimizer, make_schedule, train_step

    optimizer = OptimizerConfig(lr=1e-6, schedule="constant", warmup_ratio=0.0)
    state = abstract_state(config, mesh, make_optimizer(optimizer), jnp.dtype(param_dtype))
    options = StepOptions(
        objective=flash_reinforce_config(3e-3),
        microbatches=microbatches,
        compute_dtype=None if dtype == param_dtype else dtype,
        optimizer=optimizer,
    )
    step_batch = abstract_batch(batch, seq_len, lambda ndim: batch_sharding(mesh, ndim=ndim))
    # TrainStep's jit: explicit shardings, the state donated.
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    step = jax.jit(
        functools.partial(
            train_step, advantages=None, options=options, schedule=make_schedule(optimizer, total_steps=1000)
        ),
        in_shardings=(state_shardings, jax.tree.map(lambda x: x.sharding, step_batch)),
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=(0,),
    )
    t0 = time.perf_counter()
    lowered = step.lower(state, step_batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, state, t1 - t0, time.perf_counter() - t1


def per_device_bytes(tree) -> float:
    """Bytes of one device's shards of a tree of sharded ShapeDtypeStructs (device 0; shardings are even)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard)) * x.dtype.itemsize
    return total


def compiled_flops(compiled) -> float:
    """FLOPs per device of a compiled executable (XLA's cost analysis)."""
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost).get("flops", float("nan"))


def flops_per_device(config, mesh, **step_kwargs) -> float:
    """Compiled FLOPs per device of the full-depth step. XLA's cost analysis counts a scanned body once, so this
    compiles the unrolled step at 1 and 2 layers and extrapolates (FLOPs are linear in depth)."""
    one, two = (
        compiled_flops(
            compile_train_step(config.replace(num_hidden_layers=n, scan_layers=False), mesh, **step_kwargs)[0]
        )
        for n in (1, 2)
    )
    return one + (two - one) * (config.num_hidden_layers - 1)


def scale_report(mesh) -> dict:
    import jax

    from ipa_jax.models import Qwen3Config
    from ipa_jax.train.metrics import active_params_per_token, train_flops_per_token

    config = Qwen3Config.from_hf_dict(
        HF_CONFIGS[FLAGS.model], moe_impl=FLAGS.moe_impl, remat_policy=FLAGS.remat, scan_layers=True
    )
    step_kwargs = dict(
        batch=FLAGS.batch,
        seq_len=FLAGS.seq_len,
        microbatches=FLAGS.microbatches,
        dtype=FLAGS.dtype,
        param_dtype=FLAGS.param_dtype,
    )
    compiled, state, lower_s, compile_s = compile_train_step(config, mesh, **step_kwargs)
    memory = compiled.memory_analysis()
    device_flops = flops_per_device(config, mesh, **step_kwargs)
    analytic = train_flops_per_token(config, FLAGS.seq_len) * FLAGS.batch * FLAGS.seq_len
    total_params = sum(x.size for x in jax.tree.leaves(state.params))
    return {
        "model": FLAGS.model,
        "mesh": dict(mesh.shape),
        "batch": FLAGS.batch,
        "seq_len": FLAGS.seq_len,
        "microbatches": FLAGS.microbatches,
        "moe_impl": FLAGS.moe_impl,
        "remat": FLAGS.remat,
        "dtype": FLAGS.dtype,
        "param_dtype": FLAGS.param_dtype,
        "params_total_billion": total_params / 1e9,
        "active_params_per_token_billion": active_params_per_token(config) / 1e9,
        "per_device_gib": {
            "params": per_device_bytes(state.params) / GIB,
            "optimizer_state": per_device_bytes(state.opt_state) / GIB,
            "arguments (state + batch)": memory.argument_size_in_bytes / GIB,
            "temp (activations, gradients, workspace)": memory.temp_size_in_bytes / GIB,
            "outputs not aliased to donated inputs": (memory.output_size_in_bytes - memory.alias_size_in_bytes) / GIB,
            "peak estimate (arguments + temp + unaliased outputs)": (
                memory.argument_size_in_bytes
                + memory.temp_size_in_bytes
                + memory.output_size_in_bytes
                - memory.alias_size_in_bytes
            )
            / GIB,
        },
        "flops_per_step": {
            "compiled_per_device": device_flops,
            "compiled_all_devices": device_flops * mesh.size,
            "analytic_6N_plus_attention_all_devices": analytic,
        },
        "seconds": {"lower": lower_s, "compile": compile_s},
    }


def compile_time_report(mesh) -> dict:
    """Lower + compile seconds of the train step of the README MoE at each depth, unrolled vs scanned."""
    from ipa_jax.models import Qwen3Config

    out = {}
    for layers in (int(x) for x in FLAGS.layers):
        for scan in (False, True):
            config = Qwen3Config.from_hf_dict(
                dict(SMALL_MOE, num_hidden_layers=layers), scan_layers=scan, remat_policy=FLAGS.remat
            )
            _, _, lower_s, compile_s = compile_train_step(
                config, mesh, batch=4, seq_len=512, microbatches=1, dtype="float32", param_dtype="float32"
            )
            key = f"{layers} layers, {'scanned' if scan else 'unrolled'}"
            out[key] = {"lower_s": lower_s, "compile_s": compile_s}
            print(f"{key:24s} lower {lower_s:6.1f}s  compile {compile_s:6.1f}s", flush=True)
    return out


def main(_):
    if FLAGS.platform == "cpu":
        devices = 1 if FLAGS.compile_time else FLAGS.devices
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from ipa_jax.models import MeshConfig, make_mesh

    if FLAGS.compile_time:
        mesh = make_mesh(MeshConfig(1, 1, 1, 1), devices=jax.devices()[:1])
        results = {"compile_time": compile_time_report(mesh), "remat": FLAGS.remat, "load_average": os.getloadavg()[0]}
    else:
        mesh = make_mesh(MeshConfig(data=-1, fsdp=FLAGS.fsdp, expert=FLAGS.expert, tensor=FLAGS.tensor))
        results = scale_report(mesh)
    print(json.dumps(results, indent=2))
    if FLAGS.out:
        with open(FLAGS.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
