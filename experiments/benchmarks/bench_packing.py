"""Sequence packing in the learner: useful (non-padding) tokens per second of the train step on packed rows
(`train.packing`, `pack_batch`) and on packed rows sharing their trajectories' common prefix (`train.share_prefix`)
next to one padded trajectory per row (`pad_batch`), on the same batches.

The model, objective and buckets are the quickstart's (configs/quickstart.py: the tiny Qwen3-MoE, IPA; one CPU
device). Two length distributions, each in --batches batches of --batch trajectories:

  quickstart  the lengths, imitation targets and common prefix (the system prompt and tool schema) of the
              quickstart's expert episodes (calculator, 2 operations), generated here with the run's tokenizer: the
              batches of its imitation warm start, its buckets
  lognormal   agentic episodes with a long tail: lognormal lengths (median --median, sigma --sigma) clipped to
              [32, --max_len], buckets 64, 128, ... up to --max_len

Every batch of both layouts first runs once (compiling each distinct shape: the compile time is reported apart),
then --rounds rounds time every batch once per layout, interleaved (a shared machine's load spreads over both).
Useful tokens per second = the real tokens of all batches / the time of all their steps.

  python experiments/benchmarks/bench_packing.py
  python experiments/benchmarks/bench_packing.py --dists=lognormal --median=512 --max_len=4096 --batch=32
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from absl import app, flags
from episode_lengths import common_prefix, synthetic_trajectories  # beside this script

from ipa_jax.host_memory import keep_freed_host_memory

flags.DEFINE_list("dists", ["quickstart", "lognormal"], "length distributions: quickstart, lognormal")
flags.DEFINE_integer("batch", 16, "trajectories per batch (the quickstart's train.batch_size)")
flags.DEFINE_integer("batches", 3, "batches per distribution")
flags.DEFINE_integer("rounds", 2, "timed passes over the batches")
flags.DEFINE_float("median", 192.0, "lognormal: median length")
flags.DEFINE_float("sigma", 1.0, "lognormal: sigma of the log length")
flags.DEFINE_integer("max_len", 1024, "lognormal: longest length and largest bucket")
flags.DEFINE_integer("seed", 0, "seed of the lengths and tokens")
flags.DEFINE_string("out", "", "also write the results as JSON here")
FLAGS = flags.FLAGS

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.py"
LAYOUTS = ("padded", "packed", "shared")


def quickstart_episodes(exp) -> tuple[list[int], list[int], int]:
    """(token lengths, imitation targets, the tokens all begin with) of the quickstart's expert episodes (64 train
    tasks) with the tokenizer its run builds."""
    from ipa_jax.chat import ChatFormat
    from ipa_jax.pipeline.tokenizer import build_corpus_tokenizer
    from ipa_jax.rollout.agent import expert_episode

    chat = ChatFormat(
        build_corpus_tokenizer(int(exp.model.arch["vocab_size"]), exp.env), enable_thinking=exp.rollout.enable_thinking
    )
    env = exp.env.make()
    episodes = [
        expert_episode(task, env.expert(task), exp.env.make(), chat, uid=str(i))
        for i, task in enumerate(env.tasks("train", 64, 0))
    ]
    return [e.length for e in episodes], [int(e.expert_mask.sum()) for e in episodes], common_prefix(episodes)


def main(_):
    import jax

    from ipa_jax.models import MeshConfig, make_mesh
    from ipa_jax.pipeline import load_config, validate
    from ipa_jax.pipeline.build import build_state, build_steps
    from ipa_jax.trajectory import pack_batch, pad_batch

    exp = validate(load_config(QUICKSTART, [f"train.batch_size={FLAGS.batch}"]))
    mesh = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    state = build_state(exp, mesh)
    step, _ = build_steps(exp, state, mesh)
    vocab = int(exp.model.arch["vocab_size"])
    rng = np.random.default_rng(FLAGS.seed)
    results = {
        "config": dict(
            batch=FLAGS.batch,
            batches=FLAGS.batches,
            rounds=FLAGS.rounds,
            median=FLAGS.median,
            sigma=FLAGS.sigma,
            max_len=FLAGS.max_len,
            moe_impl=exp.model.moe_impl,
            device=jax.devices()[0].device_kind,
            threads=len(os.sched_getaffinity(0)),
            load_average_start=os.getloadavg()[0],
        )
    }
    # Each layout keeps its own copy of the state: the step donates it.
    holders = {layout: jax.tree.map(lambda x: x.copy(), state) for layout in LAYOUTS}

    def run(layout, device_batch):
        holders[layout], metrics = step(holders[layout], device_batch)
        return float(metrics["loss"])  # blocks until the step is done

    for dist in FLAGS.dists:
        if dist == "quickstart":
            pool, targets, common = quickstart_episodes(exp)
            buckets = exp.train.buckets
            picks = [rng.integers(0, len(pool), FLAGS.batch) for _ in range(FLAGS.batches)]
            draws = [np.asarray(pool)[p] for p in picks]
            scored = [np.asarray(targets)[p] for p in picks]
        elif dist == "lognormal":
            buckets = tuple(2**k for k in range(6, 20) if 2**k <= FLAGS.max_len)
            draws = [
                np.clip(rng.lognormal(np.log(FLAGS.median), FLAGS.sigma, FLAGS.batch), 32, FLAGS.max_len).astype(int)
                for _ in range(FLAGS.batches)
            ]
            scored, common = [None] * FLAGS.batches, 0
        else:
            raise ValueError(f"--dists: unknown distribution {dist!r}")
        host = {layout: [] for layout in LAYOUTS}
        for lengths, targets in zip(draws, scored, strict=True):
            trajs = synthetic_trajectories(lengths, vocab, rng, targets, common)
            host["padded"].append(pad_batch(trajs, buckets))
            for layout, share in (("packed", False), ("shared", True)):
                batch = pack_batch(trajs, buckets, row_multiple=exp.train.microbatches, share_prefix=share)[0]
                host[layout].append(batch)
        batches = {layout: [step.put_batch(b) for b in bs] for layout, bs in host.items()}
        compile_s, times = {}, dict.fromkeys(LAYOUTS, 0.0)
        for layout, bs in batches.items():
            t0 = time.perf_counter()
            for b in bs:
                run(layout, b)
            compile_s[layout] = time.perf_counter() - t0
        for _ in range(FLAGS.rounds):
            for i in range(FLAGS.batches):
                for layout in LAYOUTS:
                    t0 = time.perf_counter()
                    run(layout, batches[layout][i])
                    times[layout] += time.perf_counter() - t0
        useful = FLAGS.rounds * sum(int(b.attention_mask.sum()) for b in host["padded"])
        out = {
            "lengths_mean": float(np.mean(draws)),
            "lengths_max": int(np.max(draws)),
            "buckets": list(buckets),
            "common_prefix": common,
        }
        for layout, bs in host.items():
            out[layout] = {
                "shapes": sorted({"x".join(map(str, b.tokens.shape)) for b in bs}),
                "fill": sum(int(b.attention_mask.sum()) for b in bs) / sum(b.tokens.size for b in bs),
                "first_pass_s (compile)": compile_s[layout],
                "seconds": times[layout],
                "useful_tokens_per_s": useful / times[layout],
            }
        for layout in ("packed", "shared"):
            out[f"{layout}_over_padded_useful_tokens_per_s"] = (
                out[layout]["useful_tokens_per_s"] / out["padded"]["useful_tokens_per_s"]
            )
        results[dist] = out
    results["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))
    if FLAGS.out:
        with open(FLAGS.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
