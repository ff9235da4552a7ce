"""Forward+backward time of a small Qwen3-MoE: ipa_jax dense-reference MoE, ipa_jax ragged MoE, transformers.

All three run the same random weights (transformers builds them, saves safetensors, ipa_jax loads them) on the
same tokens and the same loss (mean next-token NLL), in float32 on CPU. Reports the median of --iters timed
steps after one warm-up (compile) step, the losses (they must agree), and the time ratios.

  python experiments/benchmarks/bench_model.py                       # 4 layers, hidden 256, 16 experts top-4, 4 x 512
  python experiments/benchmarks/bench_model.py --batch=2 --seq_len=256  # smaller, for a busy 2-core machine
"""

from __future__ import annotations

import statistics
import tempfile
import time

from absl import app, flags

flags.DEFINE_integer("layers", 4, "decoder layers")
flags.DEFINE_integer("hidden", 256, "hidden size")
flags.DEFINE_integer("experts", 16, "experts per MoE layer")
flags.DEFINE_integer("top_k", 4, "experts per token")
flags.DEFINE_integer("moe_width", 128, "moe_intermediate_size")
flags.DEFINE_integer("vocab", 2048, "vocabulary size")
flags.DEFINE_integer("batch", 4, "batch size")
flags.DEFINE_integer("seq_len", 512, "sequence length")
flags.DEFINE_integer("iters", 3, "timed iterations per implementation")
flags.DEFINE_integer("threads", 0, "torch intra-op threads (0 = torch default)")
FLAGS = flags.FLAGS


def _median_time(step, iters: int) -> tuple[float, float]:
    """(loss of the warm-up call, median seconds of `iters` further calls); step() must block until done."""
    loss = step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return loss, statistics.median(times)


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
        vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden, intermediate_size=4 * FLAGS.hidden,
        moe_intermediate_size=FLAGS.moe_width, num_hidden_layers=FLAGS.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=FLAGS.hidden // 4, num_experts=FLAGS.experts,
        num_experts_per_tok=FLAGS.top_k, norm_topk_prob=True, max_position_embeddings=4 * FLAGS.seq_len)
    hf = transformers.Qwen3MoeForCausalLM(hf_config).float()
    # Spread the router (init std 0.02 routes almost uniformly at random; real routers are confident).
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.mul_(20)
    tokens = np.random.RandomState(0).randint(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq_len))

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        model = from_pretrained(tmp)
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.asarray(tokens, jnp.int32)

    def loss_fn(p, moe_impl):
        logits = nnx.merge(graphdef, p)(ids, moe_impl=moe_impl).logits
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

    results = {}
    for impl in ("dense", "ragged"):
        fn = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, impl))
        compile_s = time.perf_counter() - t0

        def step(fn=fn, impl=impl):
            loss, grads = jax.block_until_ready(fn(params, impl))
            return float(loss)

        loss, seconds = _median_time(step, FLAGS.iters)
        results[f"ipa_jax {impl}"] = (loss, seconds)
        print(f"ipa_jax {impl:6s}: compile+first {compile_s:6.2f}s", flush=True)

    torch_ids = torch.tensor(tokens, dtype=torch.long)

    def torch_step():
        hf.zero_grad(set_to_none=True)
        logits = hf(input_ids=torch_ids).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        loss = -logp.gather(-1, torch_ids[:, 1:, None]).mean()
        loss.backward()
        return loss.item()

    results["transformers"] = _median_time(torch_step, FLAGS.iters)

    print(f"\nQwen3-MoE fwd+bwd, float32 CPU ({jax.devices()[0].device_kind}, "
          f"torch threads {torch.get_num_threads()}): "
          f"{FLAGS.layers} layers, hidden {FLAGS.hidden}, {FLAGS.experts} experts top-{FLAGS.top_k} "
          f"(width {FLAGS.moe_width}), vocab {FLAGS.vocab}, batch {FLAGS.batch} x {FLAGS.seq_len}; "
          f"median of {FLAGS.iters}")
    hf_time = results["transformers"][1]
    for name, (loss, seconds) in results.items():
        print(f"  {name:16s} loss {loss:.6f}  {seconds * 1e3:9.1f} ms  ratio to transformers {seconds / hf_time:5.2f}")
    print(f"  ragged / dense: {results['ipa_jax ragged'][1] / results['ipa_jax dense'][1]:.2f}")
    losses = [loss for loss, _ in results.values()]
    if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        raise SystemExit(f"losses disagree: {losses}")


if __name__ == "__main__":
    app.run(main)
