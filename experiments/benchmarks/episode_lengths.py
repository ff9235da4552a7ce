"""Episode token lengths of a run, as a small JSON file the learner benchmark draws its batches from
(bench_learner.py --lengths), and the synthetic trajectories of given lengths that the benchmarks train on.

Recording reads the trajectories the learner consumed (<run_dir>/trajectories/train.jsonl) and the run's
config.json (its train.batch_size and train.buckets, the rows a packed learner step fills). Per episode it keeps
the length and the scored tokens (action tokens, or an expert episode's imitation targets): the learner computes
the LM head only where tokens are scored (`token_logprobs(scored=...)`), so their count shapes the step's cost.
Per run it keeps the common prefix: the tokens every recorded episode begins with (the system prompt and tool
schema of an agentic task), which `train.share_prefix` holds once per packed row.

  python experiments/benchmarks/episode_lengths.py --run_dir=runs/quickstart --out=lengths.json

kind: "rollout" (the policy's own episodes: those with action tokens, what RL feeds the learner), "expert" (the
scripted imitation episodes: no action token) or "all".
"""

from __future__ import annotations

import json
import os

import numpy as np

KINDS = ("rollout", "expert", "all")


def record_lengths(run_dir: str, kind: str = "rollout") -> dict:
    """{"run", "kind", "batch_size", "buckets", "lengths", "scored_tokens", "common_prefix"}: the token length and
    the number of action or expert tokens of every consumed trajectory of `kind`, in the order the learner consumed
    them, the number of tokens they all begin with, and the run's batch size and buckets."""
    from ipa_jax.pipeline.run_folder import RunFolder

    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {KINDS}, got {kind!r}")
    folder = RunFolder(run_dir)
    train = folder.read_config()["train"]
    trajs = folder.read_trajectories("train")
    rollout = {"rollout": True, "expert": False}.get(kind)
    kept = [tr for tr in trajs if rollout is None or bool(tr.action_mask.any()) == rollout]
    if not kept:
        raise ValueError(f"{folder.trajectories_path('train')}: no {kind} trajectories (of {len(trajs)} consumed)")
    return {
        "run": os.path.basename(os.path.normpath(run_dir)),
        "kind": kind,
        "batch_size": int(train["batch_size"]),
        "buckets": [int(b) for b in train["buckets"]],
        "lengths": [tr.length for tr in kept],
        "scored_tokens": [int((tr.action_mask | tr.expert_mask).sum()) for tr in kept],
        "common_prefix": common_prefix(kept),
    }


def common_prefix(trajs) -> int:
    """The number of tokens every trajectory begins with, short of the shortest's length (each keeps one of its
    own)."""
    common = min(tr.length for tr in trajs) - 1
    for tr in trajs[1:]:
        differ = np.flatnonzero(tr.tokens[:common] != trajs[0].tokens[:common])
        common = int(differ[0]) if differ.size else common
    return common


def load_lengths(path: str) -> dict:
    """A record_lengths JSON file, checked: integer lengths >= 2, each fitting the largest bucket, and per
    episode 1 to length - 1 scored tokens; a common prefix shorter than every episode (0 when absent: files
    recorded before it was)."""
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    missing = {"batch_size", "buckets", "lengths", "scored_tokens"} - set(record)
    if missing:
        raise ValueError(f"{path}: not an episode-lengths file (missing {sorted(missing)})")
    lengths, scored, buckets = record["lengths"], record["scored_tokens"], record["buckets"]
    if not lengths or not all(isinstance(n, int) and n >= 2 for n in lengths):
        raise ValueError(f"{path}: 'lengths' must be a non-empty list of integers >= 2")
    if len(scored) != len(lengths) or not all(isinstance(a, int) and 1 <= a < n for a, n in zip(scored, lengths)):
        raise ValueError(f"{path}: 'scored_tokens' must give each episode 1 to length - 1 scored tokens")
    if not buckets or max(lengths) > max(buckets):
        raise ValueError(f"{path}: the longest episode ({max(lengths)}) exceeds the largest bucket {buckets}")
    if not isinstance(record["batch_size"], int) or record["batch_size"] < 1:
        raise ValueError(f"{path}: 'batch_size' must be a positive integer, got {record['batch_size']!r}")
    common = record.setdefault("common_prefix", 0)
    if not isinstance(common, int) or not 0 <= common < min(lengths):
        raise ValueError(f"{path}: 'common_prefix' must be an integer in [0, {min(lengths)}), got {common!r}")
    return record


def _action_layout(n: int, actions: int | None, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """(action mask bool[n], the last position of each turn). actions None: from the first third on, turns of 8-32
    action tokens separated by 4-12 observation tokens. Else exactly `actions` action tokens in turns of at most 32,
    with up to 12 observation tokens between them and the rest as the prompt; the last turn ends the episode."""
    action = np.zeros(n, bool)
    if actions is None:
        t, ends = max(1, n // 3), []
        while t < n:
            stop = min(t + int(rng.integers(8, 33)), n)
            action[t:stop] = True
            ends.append(stop - 1)
            t = stop + int(rng.integers(4, 13))
        return action, ends
    turns = -(-actions // 32)
    sizes = np.diff(np.linspace(0, actions, turns + 1).astype(int))
    gap = min(12, (n - actions - 1) // turns)  # observation tokens after each turn but the last
    t, ends = n - actions - gap * (turns - 1), []
    for size in sizes:
        action[t : t + size] = True
        ends.append(t + size - 1)
        t += size + gap
    return action, ends


def synthetic_trajectories(lengths, vocab: int, rng: np.random.Generator, scored_tokens=None, common_prefix=0):
    """Trajectories of the given lengths, with scored_tokens[i] action tokens each (None: a third of the episode
    as the prompt, then turns; `_action_layout`); behaviour log-probs near log(1/V), 0/1 rewards. All begin with
    the same `common_prefix` random tokens, and differ right after them."""
    from ipa_jax.trajectory import Trajectory, build_chunk_ids

    prompt = rng.integers(0, vocab, common_prefix + 1)
    out = []
    for i, n in enumerate(lengths):
        action, ends = _action_layout(int(n), None if scored_tokens is None else int(scored_tokens[i]), rng)
        behavior = np.where(action, -np.log(vocab) + rng.normal(0, 0.05, n), 0.0)
        tokens = rng.integers(0, vocab, n)
        tokens[:common_prefix] = prompt[:common_prefix]
        tokens[common_prefix] = (prompt[common_prefix] + 1 + i % (vocab - 1)) % vocab  # not the prompt's next
        out.append(
            Trajectory(
                uid=str(i),
                tokens=tokens,
                action_mask=action,
                behavior_logprobs=np.minimum(behavior, -1e-3) * action,
                chunk_ids=build_chunk_ids(action, ends),
                expert_mask=np.zeros(n, bool),
                reward=float(rng.random() < 0.5),
                policy_version=0,
                info={"task_id": str(i % 4)},
            )
        )
    return out


def length_batches(record: dict, count: int, vocab: int, rng: np.random.Generator, buckets=None) -> list[tuple]:
    """`count` batches of record["batch_size"] episodes drawn from the record (length and scored tokens together,
    all beginning with its common prefix); each as (lengths int[B], padded, packed, shared): padded one episode per
    row to the batch's longest (pad_batch), packed several per row of the bucket that needs the fewest positions, as the
    run's learner packs them (pack_batch; buckets: record["buckets"] unless given), and shared the same with
    share_prefix (train.share_prefix)."""
    from ipa_jax.trajectory import pack_batch, pad_batch

    buckets = record["buckets"] if buckets is None else buckets
    out = []
    for _ in range(count):
        drawn = rng.integers(0, len(record["lengths"]), record["batch_size"])
        lengths = np.asarray(record["lengths"])[drawn]
        scored = np.asarray(record["scored_tokens"])[drawn]
        trajs = synthetic_trajectories(lengths, vocab, rng, scored, record.get("common_prefix", 0))
        padded = pad_batch(trajs, (int(lengths.max()),))
        out.append((lengths, padded, pack_batch(trajs, buckets)[0], pack_batch(trajs, buckets, share_prefix=True)[0]))
    return out


def main(_):
    from absl import flags

    record = record_lengths(flags.FLAGS.run_dir, flags.FLAGS.kind)
    with open(flags.FLAGS.out, "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.write("\n")
    n, a = record["lengths"], record["scored_tokens"]
    print(
        f"{len(n)} {record['kind']} episodes: mean {np.mean(n):.1f}, max {max(n)} tokens, "
        f"mean {np.mean(a):.1f} scored -> {flags.FLAGS.out}"
    )


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("run_dir", None, "a run folder (with trajectories/train.jsonl and config.json)", required=True)
    flags.DEFINE_enum("kind", "rollout", KINDS, "which consumed trajectories")
    flags.DEFINE_string("out", None, "the JSON file to write", required=True)
    app.run(main)
