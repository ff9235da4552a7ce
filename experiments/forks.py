"""Where a policy's success is decided: success rate from every expert anchor of a task.

    python experiments/forks.py --config=configs/resample_plain.py [--policy=runs/quickstart/hf] \\
        [--tasks=16] [--samples=8] [--split=eval] [--out=forks.json] [--per_task]

For each of `--tasks` tasks of the config's environment, `--samples` episodes of the policy (the config's rollout
temperature) start at each anchor j = 0..K (the state after the scripted expert's first j chunks;
`ipa_jax.pipeline.forks.probe_policy`). Prints the success rate per anchor over tasks and how many tasks have their
crucial fork there (the anchor whose rate exceeds the previous one's by >= resample.fork_jump the most); --out
writes the per-task estimates as JSON.
"""

import json

from absl import app, flags

from ipa_jax.host_memory import keep_freed_host_memory
from ipa_jax.pipeline.cli import ConfigFlags, exit_on_config_error
from ipa_jax.pipeline.forks import probe_policy
from ipa_jax.rollout.resample import forks_by_anchor

CONFIG = ConfigFlags("Experiment config (env, rollout, model.tokenizer).")
flags.DEFINE_string("policy", None, "HF model folder; default: the config's model.path.")
flags.DEFINE_integer("tasks", 16, "Tasks to probe.")
flags.DEFINE_integer("samples", 8, "Episodes per task and anchor.")
flags.DEFINE_enum("split", "eval", ["train", "eval"], "Task split (eval: the held-out tasks runs evaluate on).")
flags.DEFINE_integer("seed", 0, "Task seed (0 = the held-out set of training runs) and sampling seed.")
flags.DEFINE_string("out", None, "Write the per-task fork estimates here (JSON).")
flags.DEFINE_bool("per_task", False, "Also print every task's rates.")
FLAGS = flags.FLAGS


@exit_on_config_error
def main(argv):
    del argv
    exp = CONFIG.experiment()
    policy = FLAGS.policy or exp.model.path
    if not policy:
        raise app.UsageError("no policy: pass --policy=<HF folder> or a config with model.path")
    estimates = probe_policy(
        exp, policy, num_tasks=FLAGS.tasks, samples=FLAGS.samples, split=FLAGS.split, seed=FLAGS.seed
    )
    print(
        f"policy {policy}: {FLAGS.tasks} {FLAGS.split} tasks x {FLAGS.samples} samples per anchor, "
        f"temperature {exp.rollout.temperature}, fork_jump {exp.resample.fork_jump}"
    )
    print(f"{'anchor':>6} {'success':>8} {'crucial forks':>14}")
    by_anchor = forks_by_anchor(estimates)
    for row in by_anchor:
        print(f"{row['anchor']:>6} {row['success']:>8.3f} {row['crucial_forks']:>14}")
    if FLAGS.per_task:
        for e in estimates:
            print(
                e.task_id,
                " ".join(f"{a}:{s}/{n}" for a, s, n in zip(e.anchors, e.successes, e.samples)),
                "fork",
                e.crucial_fork,
            )
    if FLAGS.out:
        with open(FLAGS.out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "policy": policy,
                    "split": FLAGS.split,
                    "samples": FLAGS.samples,
                    "anchors": by_anchor,
                    "tasks": [e.to_dict() for e in estimates],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main, flags_parser=CONFIG.parse)
