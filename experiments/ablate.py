"""Run a set of ablation configs over several seeds, then write a comparison table and plots into one folder.

    python experiments/ablate.py --list                                  # the configs and presets
    python experiments/ablate.py --preset=small                          # -> runs/ablations/small/
    python experiments/ablate.py --configs=credit_chunk,configs/ablations/credit_token.py --seeds=0,1 \\
        --set=train.steps=60 --set=train.il_warmup_steps=40 --out=runs/ablations/mine
    python experiments/ablate.py --preset=credit --eval_tasks=256 --eval_samples=4 --claim=lower
    python experiments/ablate.py --preset=claims --from_results         # the tables from results/claims/ alone

Presets are files of configs/sweeps/ (or a preset file's path); configs are named by file (`credit_token` =
configs/ablations/credit_token.py) or given as paths; every --set override (and --steps, --eval_tasks,
--eval_samples) applies to every arm. One line per finished run (arm, seed, held-out success, time, the sweep's
progress); then the table: per config the mean over seeds with a 95% interval over seeds and held-out tasks, and
its paired difference with --reference (the first config by default) with a verdict on --claim
(docs/statistics.md). The sweep is `ipa_jax.analysis.sweep`; notebooks/ablations.ipynb reads the same folder.

A preset's sweep also writes each finished run's results file into --results (default results/<preset>): per run
its numbers and per-task outcomes, small enough to commit. Rerunning the command skips the runs already finished
(in --out, or in --results when their config matches), and --from_results rebuilds every table from --results alone.
A preset with conditions (e.g. claims: the calculator at 2 and 3 operations, expert error 0 and 0.5) runs the whole
sweep once per condition: <out>/<condition>, <results>/<condition>.
"""

import logging
import os
import sys

from absl import app, flags

from ipa_jax.analysis.presets import Preset, listing, preset_files, resolve_preset
from ipa_jax.analysis.stats import CLAIMS
from ipa_jax.analysis.sweep import resolve_config, sweep, tables_from_results
from ipa_jax.host_memory import keep_freed_host_memory
from ipa_jax.pipeline.cli import exit_on_config_error, quiet_library_logs
from ipa_jax.pipeline.config import split_override

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_DIR = os.path.join(os.path.dirname(HERE), "configs", "ablations")
SWEEP_DIR = os.path.join(os.path.dirname(HERE), "configs", "sweeps")

flags.DEFINE_string(
    "preset",
    None,
    f"A named set of configs and seeds: {', '.join(preset_files(SWEEP_DIR))} "
    "(files of configs/sweeps/), or a preset file's path.",
)
flags.DEFINE_list("configs", None, "Comma-separated configs: names in configs/ablations/ or paths to .py files.")
flags.DEFINE_list("seeds", None, "Comma-separated seeds (default: the preset's; 0,1,2 with --configs).")
flags.DEFINE_string("out", None, "Output folder (run folders, table, plots); default runs/ablations/<preset>.")
flags.DEFINE_multi_string("set", [], "KEY=VALUE config override for every arm, e.g. --set=train.steps=50 (repeat).")
flags.DEFINE_integer("steps", None, "Shorthand for --set=train.steps=N.")
flags.DEFINE_integer(
    "eval_tasks",
    None,
    "Held-out tasks per evaluation, every arm (--set=train.eval_episodes=N); the same tasks for every arm and seed.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "eval_samples",
    None,
    "Episodes per held-out task and evaluation, every arm "
    "(--set=train.eval_samples=N); > 1 samples at the rollout temperature unless "
    "rollout.eval_temperature is > 0.",
    lower_bound=1,
)
flags.DEFINE_string(
    "reference", None, "The config the paired differences are taken against; default the preset's, else the first."
)
flags.DEFINE_enum(
    "claim",
    None,
    list(CLAIMS),
    "The claimed direction of (config - reference) the verdicts judge: "
    "higher (each config beats the reference) or lower (the reference beats each config); default "
    "the preset's, else higher.",
)
flags.DEFINE_float("threshold", 0.5, "Held-out success for the 'steps to threshold' column.")
flags.DEFINE_enum("isolation", "subprocess", ["subprocess", "inprocess"], "One process per run, or all in this one.")
flags.DEFINE_bool("rerun", False, "Delete and retrain runs that already finished in --out.")
flags.DEFINE_bool(
    "share_warm_start",
    True,
    "Train the IL warm start once per seed for configs that differ only in "
    "the RL phase, and start each of them from it.",
)
flags.DEFINE_string(
    "results",
    None,
    "Folder of the runs' results files (committed-friendly); default results/<preset> with --preset, none with "
    "--configs; '' = none.",
)
flags.DEFINE_bool("from_results", False, "Train nothing: rebuild the tables from --results into --out.")
flags.DEFINE_bool("list", False, "List the ablation configs and presets, then exit.")
FLAGS = flags.FLAGS
SHORTHANDS = (("steps", "train.steps"), ("eval_tasks", "train.eval_episodes"), ("eval_samples", "train.eval_samples"))


@exit_on_config_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.list:
        return print(listing(SWEEP_DIR, CONFIG_DIR))
    if (FLAGS.preset is None) == (FLAGS.configs is None):
        raise app.UsageError("give exactly one of --preset or --configs (--list shows them)")
    flag = "preset" if FLAGS.preset else "configs"
    try:
        name, preset = (
            resolve_preset(FLAGS.preset, SWEEP_DIR)
            if FLAGS.preset
            else ("custom", Preset(tuple(FLAGS.configs), (0, 1, 2)))
        )
        configs = [resolve_config(c, CONFIG_DIR) for c in preset.configs]
    except ValueError as e:
        raise app.UsageError(f"--{flag}: {e}") from None
    seeds = tuple(int(s) for s in FLAGS.seeds) if FLAGS.seeds is not None else preset.seeds
    command_line = dict(split_override(s) for s in FLAGS.set) | {
        key: FLAGS[f].value for f, key in SHORTHANDS if FLAGS[f].value is not None
    }
    reference = FLAGS.reference if FLAGS.reference is not None else preset.reference
    if reference is not None and reference not in [n for n, _ in configs]:
        raise app.UsageError(
            f"--reference must be one of the configs ({', '.join(n for n, _ in configs)}), got {reference!r}"
        )
    quiet_library_logs()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train = [sys.executable, os.path.join(HERE, "train.py")] if FLAGS.isolation == "subprocess" else None
    results = FLAGS.results if FLAGS.results is not None else (os.path.join("results", name) if FLAGS.preset else "")
    if FLAGS.from_results and not results:
        raise app.UsageError("--from_results needs --results (the folder of the results files)")
    out = os.path.abspath(FLAGS.out or os.path.join("runs", "ablations", name))
    comparison = dict(
        threshold=FLAGS.threshold,
        reference=reference,
        claim=FLAGS.claim or preset.claim,
        controls=[c for c in preset.controls if c != dict(preset.pairs).get(c, reference or preset.configs[0])],
        effect=preset.effect,
        pairs=dict(preset.pairs),
    )
    failed = False
    for condition, condition_overrides in preset.conditions or (("", ()),):
        where = os.path.join(out, condition) if condition else out
        results_dir = os.path.abspath(os.path.join(results, condition)) if results else None
        if condition:
            print(f"condition {condition}: {dict(condition_overrides)}", flush=True)
        if FLAGS.from_results:
            try:
                tables_from_results([n for n, _ in configs], seeds, results_dir, where, **comparison)
            except FileNotFoundError as e:
                raise app.UsageError(f"--from_results: {e}; run the sweep first (without --from_results)") from None
            continue
        manifest = sweep(
            configs,
            seeds,
            where,
            overrides=dict(preset.overrides) | dict(condition_overrides) | command_line,
            train_command=train,
            rerun=FLAGS.rerun,
            share_warm_start=FLAGS.share_warm_start,
            results_dir=results_dir,
            **comparison,
        )
        failed = failed or bool(manifest["failed"])
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
