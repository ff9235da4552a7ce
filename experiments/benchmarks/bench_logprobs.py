"""The LM head's log-probs and their gradient at the scored tokens: one row at a time against a batch's rows together.

`blockwise_logprobs` (models/logprobs.py) computes the logits only in the blocks that scored positions fill. One row
at a time (groups=None) the batch pays its longest row's blocks in every row; with the rows' scored positions
gathered together (groups=1, what `token_logprobs` does on one device) it pays the blocks they fill together. Both
are timed, forward and backward (d hidden, d lm_head), next to the full-logits reference (`reference_logprobs`:
every position, as a plain transformers loop computes them), on the same hidden states, in interleaved rounds
(timing.py), for rows whose scored counts are even (every row --even_share of its tokens) and uneven (drawn
uniformly between 10% and 90% of the row: agentic batches, where some episodes act for long and others stop
early). The values must agree.

  python experiments/benchmarks/bench_logprobs.py                        # 8 x 512, hidden 256, vocab 8192
  python experiments/benchmarks/bench_logprobs.py --batch=4 --seq_len=2048 --vocab=32768
"""

from __future__ import annotations

import statistics

from absl import app, flags
from timing import paired_ratio, time_round_robin  # experiments/benchmarks/timing.py, beside this script

from ipa_jax.host_memory import keep_freed_host_memory

flags.DEFINE_integer("batch", 8, "rows")
flags.DEFINE_integer("seq_len", 512, "positions per row")
flags.DEFINE_integer("hidden", 256, "hidden size")
flags.DEFINE_integer("vocab", 8192, "vocabulary size")
flags.DEFINE_integer("block_size", 128, "positions per block and row (model.logprob_block_size)")
flags.DEFINE_float("even_share", 0.75, "the even case: scored share of every row")
flags.DEFINE_integer("keep_logits_mib", 256, "keep the forward's logits for the backward up to this size")
flags.DEFINE_integer("iters", 10, "timed rounds")
flags.DEFINE_integer("seed", 0, "seed of the hidden states and scored counts")
FLAGS = flags.FLAGS


def main(_):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ipa_jax.models import blockwise_logprobs
    from ipa_jax.models.logprobs import reference_logprobs

    b, n = FLAGS.batch, FLAGS.seq_len
    rng = np.random.default_rng(FLAGS.seed)
    hidden = jnp.asarray(rng.normal(0, 0.1, (b, n, FLAGS.hidden)), jnp.float32)
    head = jnp.asarray(rng.normal(0, 0.05, (FLAGS.hidden, FLAGS.vocab)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, FLAGS.vocab, (b, n)), jnp.int32)
    counts = {
        "even": np.full(b, int(FLAGS.even_share * n)),
        "uneven": rng.integers(int(0.1 * n), int(0.9 * n) + 1, b),
    }
    keep = FLAGS.keep_logits_mib << 20

    def time_variants(scored):
        """{variant: seconds of each round} of the loss sum_scored log p and its gradient; the values agree."""

        def value_and_grad(logprobs):
            loss = lambda h, w: jnp.sum(jnp.where(scored, logprobs(h, w), 0.0))  # noqa: E731
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

        def blocked(groups):
            def logprobs(h, w):
                return blockwise_logprobs(
                    h, w, targets, block_size=FLAGS.block_size, scored=scored, keep_logits_bytes=keep, groups=groups
                )[0]

            return logprobs

        jitted = {
            "per_row": value_and_grad(blocked(None)),
            "gathered": value_and_grad(blocked(1)),
            "full_logits": value_and_grad(lambda h, w: reference_logprobs(h, w, targets)[0]),
        }
        values = {name: float(fn(hidden, head)[0]) for name, fn in jitted.items()}
        for name in ("per_row", "gathered"):
            np.testing.assert_allclose(values[name], values["full_logits"], rtol=1e-4)
        return time_round_robin(
            {name: (lambda fn=fn: jax.block_until_ready(fn(hidden, head))) for name, fn in jitted.items()}, FLAGS.iters
        )

    results = {}
    for case, count in counts.items():
        # each row's scored positions spread over the row (actions between observations)
        scored = np.zeros((b, n), bool)
        for row, c in enumerate(count):
            scored[row, rng.choice(n, c, replace=False)] = True
        rounds = time_variants(jnp.asarray(scored))
        blocks = lambda per_block, most: -(-int(most) // per_block)  # noqa: E731
        results[case] = {
            "scored_per_row": count.tolist(),
            "positions": {
                "per_row": blocks(FLAGS.block_size, count.max()) * FLAGS.block_size * b,
                "gathered": blocks(FLAGS.block_size * b, count.sum()) * FLAGS.block_size * b,
                "full_logits": b * n,
            },
            **{name: {"min_s": min(t), "median_s": statistics.median(t)} for name, t in rounds.items()},
            "per_row_over_gathered": paired_ratio(rounds["per_row"], rounds["gathered"]),
            "full_logits_over_gathered": paired_ratio(rounds["full_logits"], rounds["gathered"]),
        }
    print(f"{b} x {n}, hidden {FLAGS.hidden}, vocab {FLAGS.vocab}, blocks of {FLAGS.block_size} positions per row")
    for case, r in results.items():
        print(f"{case}: scored per row {r['scored_per_row']}, positions computed {r['positions']}")
        for name in ("per_row", "gathered", "full_logits"):
            print(f"  {name:12s} {r[name]['min_s'] * 1e3:8.1f} / {r[name]['median_s'] * 1e3:8.1f} ms (min / median)")
        for key in ("per_row_over_gathered", "full_logits_over_gathered"):
            p = r[key]
            print(f"  {key}: {p['median']:.2f} [{p['low']:.2f}, {p['high']:.2f}] (paired median, 95% interval)")


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
