"""Forward+backward time of a small Qwen3-MoE: ipa_jax's MoE / attention paths next to transformers.

Every variant runs the same random weights (transformers builds them, saves safetensors, ipa_jax loads them) on the
same tokens and the same loss (mean next-token NLL), in float32 on CPU. A variant is MOE_IMPL/ATTENTION_IMPL
(models/moe.py, models/attention.py); "auto/auto" is the default the learner runs, "dense/reference" the reference
paths. After one warm-up (compile) call each, --iters rounds time every variant once per round (interleaved, so a
shared machine's load spreads over all of them; each after a short pause: timing.py); the ratios to
transformers come from the minima (the least disturbed measurements). The losses must agree.

  python experiments/benchmarks/bench_model.py                       # 4 layers, hidden 256, 16 experts top-4, 4 x 512
  python experiments/benchmarks/bench_model.py --variants=auto/auto,blocked/reference,dense/auto
  python experiments/benchmarks/bench_model.py --batch=2 --seq_len=256  # smaller, for a busy 2-core machine
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from absl import app, flags
from timing import time_round_robin  # experiments/benchmarks/timing.py, beside this script

from ipa_jax.host_memory import keep_freed_host_memory

flags.DEFINE_integer("layers", 4, "decoder layers")
flags.DEFINE_integer("hidden", 256, "hidden size")
flags.DEFINE_integer("experts", 16, "experts per MoE layer")
flags.DEFINE_integer("top_k", 4, "experts per token")
flags.DEFINE_integer("moe_width", 128, "moe_intermediate_size")
flags.DEFINE_integer("vocab", 2048, "vocabulary size")
flags.DEFINE_integer("batch", 4, "batch size")
flags.DEFINE_integer("seq_len", 512, "sequence length")
flags.DEFINE_integer("iters", 5, "timed rounds (each variant once per round)")
flags.DEFINE_list(
    "variants", ["auto/auto", "dense/reference", "ragged/auto"], "ipa_jax variants MOE_IMPL/ATTENTION_IMPL"
)
flags.DEFINE_integer("threads", 0, "torch intra-op threads (0 = torch default)")
FLAGS = flags.FLAGS


def main(_):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from ipa_jax.models import from_pretrained

    if FLAGS.threads:
        torch.set_num_threads(FLAGS.threads)
    torch.manual_seed(0)
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=FLAGS.vocab,
        hidden_size=FLAGS.hidden,
        intermediate_size=4 * FLAGS.hidden,
        moe_intermediate_size=FLAGS.moe_width,
        num_hidden_layers=FLAGS.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=FLAGS.hidden // 4,
        num_experts=FLAGS.experts,
        num_experts_per_tok=FLAGS.top_k,
        norm_topk_prob=True,
        max_position_embeddings=4 * FLAGS.seq_len,
    )
    hf = transformers.Qwen3MoeForCausalLM(hf_config).float()
    # Spread the router (init std 0.02 routes almost uniformly at random; real routers are confident).
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.mul_(20)
    tokens = np.random.RandomState(0).randint(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq_len))
    ids = jnp.asarray(tokens, jnp.int32)

    def loss_fn(params, graphdef, moe_impl):
        logits = nnx.merge(graphdef, params)(ids, moe_impl=moe_impl).logits
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    grad_fn = jax.jit(jax.value_and_grad(loss_fn), static_argnums=(1, 2))
    steps, compile_s = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        for variant in FLAGS.variants:
            moe_impl, attention_impl = variant.split("/")
            graphdef, params = nnx.split(from_pretrained(tmp, attention_impl=attention_impl), nnx.Param)
            t0 = time.perf_counter()
            jax.block_until_ready(grad_fn(params, graphdef, moe_impl))
            compile_s[variant] = time.perf_counter() - t0

            def step(params=params, graphdef=graphdef, moe_impl=moe_impl):
                loss, _ = jax.block_until_ready(grad_fn(params, graphdef, moe_impl))
                return float(loss)

            steps[f"ipa_jax {variant}"] = step

    torch_ids = torch.tensor(tokens, dtype=torch.long)

    def torch_step():
        hf.zero_grad(set_to_none=True)
        logits = hf(input_ids=torch_ids).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        loss = -logp.gather(-1, torch_ids[:, 1:, None]).mean()
        loss.backward()
        return loss.item()

    steps["transformers"] = torch_step
    losses = {name: step() for name, step in steps.items()}
    load_before = os.getloadavg()[0]
    times = time_round_robin(steps, FLAGS.iters)
    print(
        f"\nQwen3-MoE fwd+bwd, float32 CPU ({jax.devices()[0].device_kind}, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}): "
        f"{FLAGS.layers} layers, hidden {FLAGS.hidden}, {FLAGS.experts} experts top-{FLAGS.top_k} "
        f"(width {FLAGS.moe_width}), vocab {FLAGS.vocab}, batch {FLAGS.batch} x {FLAGS.seq_len}; "
        f"{FLAGS.iters} interleaved rounds"
    )
    hf_time = min(times["transformers"])
    for name, t in times.items():
        variant = name.removeprefix("ipa_jax ")
        compiled = f"  compile+first {compile_s[variant]:5.1f}s" if variant in compile_s else ""
        print(
            f"  {name:28s} loss {losses[name]:.6f}  min {min(t) * 1e3:8.1f} ms  median "
            f"{statistics.median(t) * 1e3:8.1f} ms  time / transformers {min(t) / hf_time:5.2f}{compiled}"
        )
    spread = max(losses.values()) - min(losses.values())
    if spread > 1e-4 * abs(losses["transformers"]):
        raise SystemExit(f"losses disagree: {losses}")


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
