"""Decode throughput of the embedded JAX engine next to transformers' `generate`, and weight-update latency.

Both engines run the same random Qwen3 weights (transformers builds them and saves safetensors; ipa_jax loads them)
in float32 on CPU, sampling at temperature 1 with no stop tokens, prompts of --prompt_len tokens. Decode tokens/s =
B * (N - 1) / (t(N new tokens) - t(1 new token)), so prefill and the first token are excluded; each time is the
minimum of --iters interleaved rounds (embedded and transformers, N and 1 new tokens, one run each per round, each
after a short pause: timing.py) after a warm-up (compile) run. Weight-update latency:
EmbeddedEngine.update_weights (read safetensors + swap), set_params_from_model (in-process swap), and a full
SGLangEngine sync (pause -> /update_weights_from_disk -> version read-back -> continue) on a dev server.

  python experiments/benchmarks/bench_engine.py                     # dense, 4 layers, hidden 256, batches 8, 32
  python experiments/benchmarks/bench_engine.py --experts=16        # Qwen3-MoE: 16 experts top-4, width 128
  python experiments/benchmarks/bench_engine.py --new_tokens=64 --iters=1   # quicker on a busy machine

On an oversubscribed machine pass --threads=1: torch's OpenMP workers spin-wait and a decode step becomes
~10x slower with 2 threads than with 1 when other processes hold the cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time

from absl import app, flags
from timing import time_round_robin  # experiments/benchmarks/timing.py, beside this script

from ipa_jax.host_memory import keep_freed_host_memory

flags.DEFINE_integer("layers", 4, "decoder layers")
flags.DEFINE_integer("hidden", 256, "hidden size")
flags.DEFINE_integer("vocab", 4096, "vocabulary size")
flags.DEFINE_integer("experts", 0, "experts per layer (0 = dense Qwen3)")
flags.DEFINE_integer("top_k", 4, "experts per token (MoE)")
flags.DEFINE_integer("moe_width", 128, "moe_intermediate_size (MoE)")
flags.DEFINE_string("moe_impl", "auto", "ipa_jax MoE path: auto | blocked | dense | ragged (models/moe.py)")
flags.DEFINE_list("batches", ["8", "32"], "batch sizes")
flags.DEFINE_integer("prompt_len", 32, "prompt tokens")
flags.DEFINE_integer("new_tokens", 128, "generated tokens per row")
flags.DEFINE_integer("iters", 3, "timed runs per measurement")
flags.DEFINE_integer("threads", 0, "torch intra-op threads (0 = torch default)")
flags.DEFINE_string("out", "", "optional JSON file for the results")
FLAGS = flags.FLAGS


def median_time(fn, iters: int) -> float:
    """Median seconds of `iters` calls of fn() after one warm-up call; fn must block until done."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(_):
    import numpy as np
    import torch
    import transformers

    from ipa_jax.engines import SamplingParams, SGLangEngine
    from ipa_jax.engines.devserver import DevServer
    from ipa_jax.engines.embedded import EmbeddedEngine
    from ipa_jax.models import from_pretrained

    if FLAGS.threads:
        torch.set_num_threads(FLAGS.threads)
    torch.manual_seed(0)
    common = dict(
        vocab_size=FLAGS.vocab,
        hidden_size=FLAGS.hidden,
        intermediate_size=3 * FLAGS.hidden,
        num_hidden_layers=FLAGS.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=FLAGS.hidden // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if FLAGS.experts:
        hf_model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **common,
                num_experts=FLAGS.experts,
                num_experts_per_tok=FLAGS.top_k,
                norm_topk_prob=True,
                moe_intermediate_size=FLAGS.moe_width,
            )
        )
    else:
        hf_model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    hf_model.eval()
    tmp = tempfile.mkdtemp(prefix="bench_engine_")
    ckpt_a, ckpt_b = f"{tmp}/a", f"{tmp}/b"
    hf_model.save_pretrained(ckpt_a)
    hf_model.save_pretrained(ckpt_b)
    n_new, p_len = FLAGS.new_tokens, FLAGS.prompt_len
    max_len = p_len + n_new
    rng = np.random.default_rng(0)
    results = {
        "config": {
            k: FLAGS[k].value
            for k in (
                "layers",
                "hidden",
                "vocab",
                "experts",
                "top_k",
                "moe_width",
                "moe_impl",
                "prompt_len",
                "new_tokens",
                "iters",
            )
        },
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg()[0],
    }
    loop = asyncio.new_event_loop()
    model = from_pretrained(ckpt_a, moe_impl=FLAGS.moe_impl)
    for b in (int(x) for x in FLAGS.batches):
        prompts = rng.integers(0, FLAGS.vocab, size=(b, p_len)).tolist()
        engine = EmbeddedEngine(model, max_len=max_len, max_batch=b, batch_buckets=(b,), decode_chunk=32)

        def run_jax(n, engine=engine, prompts=prompts):
            out = loop.run_until_complete(engine.generate(prompts, SamplingParams(n)))
            assert all(len(r.token_ids) == n for r in out)

        ids = torch.tensor(prompts)

        def run_hf(n, ids=ids):
            with torch.no_grad():
                out = hf_model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=True,
                    top_k=0,
                    top_p=1.0,
                    temperature=1.0,
                    pad_token_id=0,
                )
            assert out.shape[1] == p_len + n

        rounds = time_round_robin(
            {
                "jax_n": lambda: run_jax(n_new),
                "jax_1": lambda: run_jax(1),
                "hf_n": lambda: run_hf(n_new),
                "hf_1": lambda: run_hf(1),
            },
            FLAGS.iters,
        )
        t = {name: min(times) for name, times in rounds.items()}
        t_jax, t_hf = t["jax_n"] - t["jax_1"], t["hf_n"] - t["hf_1"]
        jax_tps, hf_tps = b * (n_new - 1) / t_jax, b * (n_new - 1) / t_hf
        results[f"batch_{b}"] = {
            "embedded_tokens_per_s": jax_tps,
            "transformers_tokens_per_s": hf_tps,
            "ratio_embedded_over_transformers": jax_tps / hf_tps,
        }
        print(
            f"batch {b:3d}: embedded {jax_tps:9.1f} tok/s   transformers {hf_tps:9.1f} tok/s   "
            f"ratio {jax_tps / hf_tps:5.2f}x",
            flush=True,
        )
        loop.run_until_complete(engine.close())

    # weight-update latency
    engine = EmbeddedEngine(model, max_len=max_len, max_batch=8)
    versions = iter(range(1, 1000))
    t_disk = median_time(lambda: loop.run_until_complete(engine.update_weights(ckpt_b, next(versions))), FLAGS.iters)
    other = from_pretrained(ckpt_b)
    t_swap = median_time(lambda: engine.set_params_from_model(other, next(versions)), FLAGS.iters)
    loop.run_until_complete(engine.close())
    server = DevServer(EmbeddedEngine(model, max_len=max_len, max_batch=8), model_path=ckpt_a).serve_in_thread()

    async def sync_once(client, version):
        await client.update_weights(ckpt_b, version)

    client = SGLangEngine([server.url])
    t_http = median_time(lambda: loop.run_until_complete(sync_once(client, next(versions))), FLAGS.iters)
    loop.run_until_complete(client.close())
    server.shutdown()
    results["weight_update_s"] = {
        "embedded_update_weights_from_disk": t_disk,
        "embedded_set_params_from_model": t_swap,
        "sglang_client_sync_one_dev_server": t_http,
    }
    print(
        f"weight update: from disk {t_disk * 1e3:.1f} ms, in-process swap {t_swap * 1e3:.3f} ms, "
        f"SGLangEngine sync via dev server {t_http * 1e3:.1f} ms",
        flush=True,
    )
    loop.close()
    print(json.dumps(results, indent=2))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
