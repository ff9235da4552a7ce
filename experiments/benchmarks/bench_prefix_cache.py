"""Multi-turn rollouts on the embedded engine with its prefix cache on and off (`rollout.prefix_cache`).

Synthetic agentic episodes on the quickstart's model shape (random weights): each episode's first prompt has
--prompt_len tokens; every turn generates --turn_tokens tokens (no stop tokens), then --observation_tokens random
"tool output" tokens are appended and the next turn is sent with the whole context, as `run_episode` does. The
defaults follow the kv_chain long-horizon task (a ~200-token first prompt, 7 turns of ~19 generated tokens, ~40
tokens of tool output and generation prompt per turn). --concurrency episodes run at once on an engine of that
many rows, each turn one request (the agent's access pattern). Both settings play the same episodes in interleaved
rounds after a compiling round; reported: the minimum round time, generated and prefilled tokens, and the ratio.

  python experiments/benchmarks/bench_prefix_cache.py
  python experiments/benchmarks/bench_prefix_cache.py --turns=3 --prompt_len=150 --observation_tokens=30  # calculator
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from absl import app, flags

from ipa_jax.host_memory import keep_freed_host_memory

flags.DEFINE_integer("episodes", 32, "episodes per round")
flags.DEFINE_integer("concurrency", 16, "episodes in flight (= engine rows)")
flags.DEFINE_integer("turns", 7, "assistant turns per episode")
flags.DEFINE_integer("prompt_len", 200, "tokens of an episode's first prompt")
flags.DEFINE_integer("turn_tokens", 19, "generated tokens per turn")
flags.DEFINE_integer("observation_tokens", 40, "tokens appended after each turn (tool output, next prompt)")
flags.DEFINE_integer("rounds", 3, "timed rounds per setting (after one compiling round each)")
flags.DEFINE_string("out", "", "optional JSON file for the results")
FLAGS = flags.FLAGS


def main(_):
    import numpy as np

    from ipa_jax.engines import SamplingParams
    from ipa_jax.engines.embedded import EmbeddedEngine
    from ipa_jax.models import Qwen3Config, init_model

    config = Qwen3Config(
        vocab_size=640,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=1024,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    )
    model = init_model(config)
    max_len = FLAGS.prompt_len + FLAGS.turns * (FLAGS.turn_tokens + FLAGS.observation_tokens)
    rng = np.random.default_rng(0)
    first = rng.integers(0, config.vocab_size, (FLAGS.episodes, FLAGS.prompt_len)).tolist()
    observations = rng.integers(0, config.vocab_size, (FLAGS.episodes, FLAGS.turns, FLAGS.observation_tokens)).tolist()
    loop = asyncio.new_event_loop()
    engines = {
        setting: EmbeddedEngine(model, max_len=max_len, max_batch=FLAGS.concurrency, prefix_cache=setting)
        for setting in (True, False)
    }

    async def episode(engine, i, slots):
        async with slots:
            row = list(first[i])
            for turn in range(FLAGS.turns):
                (res,) = await engine.generate([row], SamplingParams(FLAGS.turn_tokens), session_ids=[str(i)])
                row += res.token_ids + observations[i][turn]

    async def play(engine):
        slots = asyncio.Semaphore(FLAGS.concurrency)
        await asyncio.gather(*(episode(engine, i, slots) for i in range(FLAGS.episodes)))

    times = {setting: [] for setting in engines}
    counts = {}
    for r in range(FLAGS.rounds + 1):
        for setting, engine in engines.items():
            before = engine.prefix_counts()
            t0 = time.perf_counter()
            loop.run_until_complete(play(engine))
            if r:  # round 0 compiles
                times[setting].append(time.perf_counter() - t0)
            after = engine.prefix_counts()
            counts[setting] = (after.prefilled - before.prefilled, after.reused - before.reused)
    generated = FLAGS.episodes * FLAGS.turns * FLAGS.turn_tokens
    results = {
        "config": {
            k: FLAGS[k].value
            for k in ("episodes", "concurrency", "turns", "prompt_len", "turn_tokens", "observation_tokens", "rounds")
        },
        "load_average_at_start": os.getloadavg()[0],
    }
    for setting, name in ((True, "prefix_cache"), (False, "no_prefix_cache")):
        best = min(times[setting])
        prefilled, reused = counts[setting]
        results[name] = {
            "seconds_min": best,
            "generated_tokens_per_s": generated / best,
            "prefilled_tokens_per_round": prefilled,
            "reused_tokens_per_round": reused,
        }
        print(
            f"{name:16s} {best:7.2f} s per round   {generated / best:8.1f} generated tok/s   "
            f"prefilled {prefilled:7d}   reused from the cache {reused:7d}",
            flush=True,
        )
    results["speedup"] = min(times[False]) / min(times[True])
    print(f"speedup (no prefix cache time / prefix cache time): {results['speedup']:.2f}x")
    for engine in engines.values():
        loop.run_until_complete(engine.close())
    loop.close()
    print(json.dumps(results, indent=2))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
