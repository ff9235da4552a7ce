"""Evaluate a trained policy on held-out tasks: success (pass@1), pass@k, reward, tool calls, tool errors, turns.

    python experiments/evaluate.py --run=runs/quickstart [--step=N] [--config.rollout.max_turns=6]
    python experiments/evaluate.py --policy=runs/quickstart/hf --config=configs/quickstart.py [--tokenizer=DIR]
        [--episodes=N] [--k=4] [--temperature=1.0] [--split=eval] [--seed=0] [--out=report.json]
        [--sglang_urls=http://h:30000,http://h2:30000]     # generate with servers that already serve the policy

A run folder gives its config.json, its tokenizer and the policy of its latest complete checkpoint (or --step); an
HF folder needs --config (environment, its kwargs, rollout budgets). The tasks are the held-out set a run's
evaluations play, so at --k = the config's train.eval_samples (1 by default) and the default temperature success is
comparable with the run's eval/success (`ipa_jax.pipeline.evaluation`). Prints a table and writes the JSON report
(per-task and per-episode outcomes) to --out (default <run>/eval/step_<8 digits>_k<k>_t<T>.json for a run folder,
else runs/evaluation.json).
"""

from absl import app, flags

from ipa_jax.host_memory import keep_freed_host_memory
from ipa_jax.pipeline.cli import ConfigFlags, exit_on_config_error
from ipa_jax.pipeline.evaluation import (
    PolicyError,
    evaluate,
    format_report,
    load_hf_policy,
    load_run_policy,
    report_path,
    write_report,
)

CONFIG = ConfigFlags("Experiment config of an HF policy (env, env.kwargs, rollout budgets).", required=False)
flags.DEFINE_string("run", None, "Run folder: its config.json, tokenizer and checkpoint.")
flags.DEFINE_integer("step", None, "Checkpoint step of --run; default: the latest complete one.")
flags.DEFINE_string("policy", None, "Hugging Face model folder (with --config).")
flags.DEFINE_string(
    "tokenizer", "", "Tokenizer folder of --policy; default: the policy folder's, else model.tokenizer."
)
flags.DEFINE_integer("episodes", None, "Held-out tasks; default: the config's train.eval_episodes.", lower_bound=1)
flags.DEFINE_integer("k", 1, "Samples per task (pass@k).", lower_bound=1)
flags.DEFINE_float(
    "temperature",
    None,
    "Sampling temperature; default: the config's rollout.eval_temperature "
    "(0 = greedy), or its rollout.temperature when that is 0 and --k > 1.",
    lower_bound=0.0,
)
flags.DEFINE_enum("split", "eval", ["train", "eval"], "Task split (eval: the held-out tasks runs evaluate on).")
flags.DEFINE_list("sglang_urls", [], "SGLang servers already serving the policy; default: the embedded engine.")
flags.DEFINE_string(
    "out", None, "JSON report; default <run>/eval/step_<8 digits>_k<k>_t<T>.json, else runs/evaluation.json."
)
flags.DEFINE_integer("seed", 0, "Sampling seed of the embedded engine (the tasks do not depend on it).")
FLAGS = flags.FLAGS


def load_policy():
    """(ExperimentConfig, Policy) of --run or --policy; app.UsageError on a bad combination or a missing policy."""
    if bool(FLAGS.run) == bool(FLAGS.policy):
        raise app.UsageError("pass exactly one of --run=<run folder> or --policy=<HF folder> --config=<config>")
    load_model = not FLAGS.sglang_urls  # the servers hold the weights
    try:
        if FLAGS.run:
            if CONFIG.path:
                raise app.UsageError(
                    "--config is for --policy: a run folder has its config.json (override its "
                    "keys with --config.KEY=VALUE)"
                )
            return load_run_policy(FLAGS.run, step=FLAGS.step, overrides=CONFIG.overrides, load_model=load_model)
        if FLAGS.step is not None:
            raise app.UsageError("--step is for --run (an HF folder holds one policy)")
        if not CONFIG.path:
            raise app.UsageError("--policy needs --config (the environment, its kwargs and the rollout budgets)")
        exp = CONFIG.experiment()
        return exp, load_hf_policy(exp, FLAGS.policy, tokenizer=FLAGS.tokenizer, load_model=load_model)
    except PolicyError as e:
        raise app.UsageError(str(e)) from None


@exit_on_config_error
def main(argv):
    del argv
    exp, policy = load_policy()
    report = evaluate(
        exp,
        policy,
        episodes=FLAGS.episodes,
        k=FLAGS.k,
        temperature=FLAGS.temperature,
        split=FLAGS.split,
        sglang_urls=FLAGS.sglang_urls,
        seed=FLAGS.seed,
    )
    out = FLAGS.out or report_path(FLAGS.run, report)
    write_report(report, out)
    print(format_report(report))
    print(f"report: {out}")


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main, flags_parser=CONFIG.parse)
