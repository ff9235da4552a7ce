"""Where a policy's success is decided: success rate from every expert anchor of a task (issue 8 item 3).

    python experiments/forks.py --config=configs/resample_plain.py [--policy=runs/quickstart/hf] \\
        [--tasks=16] [--samples=8] [--split=eval] [--out=forks.json] [--per_task]

For each of `--tasks` tasks of the config's environment, `--samples` episodes of the policy (the config's
rollout temperature) start at each anchor j = 0..K (the state after the scripted expert's first j chunks,
`ipa_jax.rollout.resample.probe_forks`). Prints the success rate per anchor over tasks and how many tasks have
their crucial fork there (the anchor whose rate exceeds the previous one's by >= resample.fork_jump the most);
--out writes the per-task ForkEstimates as JSON. Anchor 0 is the plain start state, anchor K the last call
made (only the answer left): a curriculum from K back to 0 (sequential rollback) has something to learn when
the rates fall off towards 0.
"""

import asyncio
import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.online import sampling_agent_config  # noqa: E402
from ipa_jax.config import ExperimentConfig, to_typed, validate  # noqa: E402
from ipa_jax.engines import EmbeddedEngine  # noqa: E402
from ipa_jax.envs import make_env  # noqa: E402
from ipa_jax.models import from_pretrained  # noqa: E402
from ipa_jax.rollout import ChatFormat  # noqa: E402
from ipa_jax.rollout.resample import ForkEstimate, build_experts, forks_by_anchor, probe_forks  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

FLAGS = flags.FLAGS


def probe_policy(exp: ExperimentConfig, policy: str, *, tokenizer: str = "", num_tasks: int = 16, samples: int = 8,
                 split: str = "eval", seed: int = 0) -> list[ForkEstimate]:
    """Per-task success by anchor of the HF policy folder `policy` on `num_tasks` tasks of exp.env (scripted
    experts; sampling as exp.rollout; the tokenizer from `tokenizer`, else exp.model.tokenizer, else `policy`)."""
    tok = AutoTokenizer.from_pretrained(tokenizer or exp.model.tokenizer or policy)
    chat = ChatFormat(tok)
    tasks = make_env(exp.env.name, **dict(exp.env.kwargs)).tasks(split, num_tasks, seed=seed)
    experts = build_experts(exp.resample, tasks, chat)
    r = exp.rollout
    engine = EmbeddedEngine(from_pretrained(policy), seed=seed, max_len=r.max_context,
                            max_batch=max(r.concurrency, 1), tokenizer=tok)
    agent = sampling_agent_config(exp)

    async def probe() -> list[ForkEstimate]:
        try:
            return await probe_forks(engine, chat, experts, samples, exp.resample.fork_jump, agent,
                                     success_reward=exp.resample.success_reward, concurrency=max(r.concurrency, 1))
        finally:
            await engine.close()

    return asyncio.run(probe())


def main(argv):
    del argv
    config = FLAGS.config
    validate(config)
    exp = to_typed(config)
    policy = FLAGS.policy or exp.model.path
    if not policy:
        raise app.UsageError("no policy: pass --policy=<HF folder> or a config with model.path")
    estimates = probe_policy(exp, policy, num_tasks=FLAGS.tasks, samples=FLAGS.samples, split=FLAGS.split,
                             seed=FLAGS.seed)
    print(f"policy {policy}: {FLAGS.tasks} {FLAGS.split} tasks x {FLAGS.samples} samples per anchor, "
          f"temperature {exp.rollout.temperature}, fork_jump {exp.resample.fork_jump}")
    print(f"{'anchor':>6} {'success':>8} {'crucial forks':>14}")
    by_anchor = forks_by_anchor(estimates)
    for row in by_anchor:
        print(f"{row['anchor']:>6} {row['success']:>8.3f} {row['crucial_forks']:>14}")
    if FLAGS.per_task:
        for e in estimates:
            print(e.task_id, " ".join(f"{a}:{s}/{n}" for a, s, n in zip(e.anchors, e.successes, e.samples)),
                  "fork", e.crucial_fork)
    if FLAGS.out:
        with open(FLAGS.out, "w", encoding="utf-8") as f:
            json.dump({"policy": policy, "split": FLAGS.split, "samples": FLAGS.samples, "anchors": by_anchor,
                       "tasks": [e.to_dict() for e in estimates]}, f, indent=1)


def define_flags() -> None:
    """The command line's flags (defined only when run as a script: tests import probe_policy alongside
    experiments/train.py, whose --config flag would clash)."""
    config_flags.DEFINE_config_file("config", None, "Experiment config (env, rollout, model.tokenizer).",
                                    lock_config=True)
    flags.DEFINE_string("policy", None, "HF model folder; default: the config's model.path.")
    flags.DEFINE_integer("tasks", 16, "Tasks to probe.")
    flags.DEFINE_integer("samples", 8, "Episodes per task and anchor.")
    flags.DEFINE_enum("split", "eval", ["train", "eval"], "Task split (eval: the held-out tasks runs evaluate on).")
    flags.DEFINE_integer("seed", 0, "Task seed (0 = the held-out set of experiments/online.py) and sampling seed.")
    flags.DEFINE_string("out", None, "Write the per-task fork estimates here (JSON).")
    flags.DEFINE_bool("per_task", False, "Also print every task's rates.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
