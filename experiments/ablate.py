"""Run a set of ablation configs over several seeds, then write a comparison table and plots into one folder.

    python experiments/ablate.py --list                                  # the configs and presets
    python experiments/ablate.py --preset=smoke                          # the machinery in minutes
    python experiments/ablate.py --preset=small                          # -> runs/ablations/small/
    python experiments/ablate.py --configs=credit_chunk,configs/ablations/credit_token.py --seeds=0,1 \\
        --set=train.steps=60 --set=train.il_warmup_steps=40 --out=runs/ablations/mine
    python experiments/ablate.py --preset=claims --from_results         # the tables from results/claims/ alone
    python experiments/ablate.py --preset=claims --from_results --effect=0.03   # seeds needed for ±3 points

Presets: configs/sweeps/; configs: names in configs/ablations/ or paths. A line per finished run, then the table
(paired differences, verdicts); results files (small, committable) go to --results. Logic: `analysis.sweep.run_preset`.
"""

import dataclasses
import logging
import os
import sys

from absl import app, flags

from ipa_jax.analysis.presets import Preset, listing, preset_files, resolve_preset
from ipa_jax.analysis.stats import CLAIMS
from ipa_jax.analysis.sweep import resolve_config, run_preset
from ipa_jax.host_memory import keep_freed_host_memory
from ipa_jax.pipeline.cli import exit_on_config_error, quiet_library_logs
from ipa_jax.pipeline.config import split_override

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_DIR = os.path.join(os.path.dirname(HERE), "configs", "ablations")
SWEEP_DIR = os.path.join(os.path.dirname(HERE), "configs", "sweeps")

flags.DEFINE_string("preset", None, f"A preset: {', '.join(preset_files(SWEEP_DIR))} (configs/sweeps/), or a path.")
flags.DEFINE_list("configs", None, "Comma-separated configs: names in configs/ablations/ or paths to .py files.")
flags.DEFINE_list("seeds", None, "Comma-separated seeds (default: the preset's; 0,1,2 with --configs).")
flags.DEFINE_string("out", None, "Output folder (run folders, table, plots); default runs/ablations/<preset>.")
flags.DEFINE_multi_string("set", [], "KEY=VALUE config override for every arm, e.g. --set=train.steps=50 (repeat).")
flags.DEFINE_integer("steps", None, "Shorthand for --set=train.steps=N.")
flags.DEFINE_integer(
    "eval_tasks", None, "Held-out tasks per evaluation (train.eval_episodes), every arm.", lower_bound=1
)
flags.DEFINE_integer("eval_samples", None, "Episodes per held-out task (train.eval_samples), every arm.", lower_bound=1)
flags.DEFINE_string(
    "reference", None, "The config differences are taken against; default the preset's, else the first."
)
flags.DEFINE_enum(
    "claim", None, list(CLAIMS), "Direction of (config - reference) judged; default the preset's, else higher."
)
flags.DEFINE_float("effect", None, "Effect of interest (success) for the 'seeds for ±E' column; default the preset's.")
flags.DEFINE_float("threshold", 0.5, "Held-out success for the 'steps to threshold' column.")
flags.DEFINE_enum("isolation", "subprocess", ["subprocess", "inprocess"], "One process per run, or all in this one.")
flags.DEFINE_bool("rerun", False, "Delete and retrain runs that already finished in --out.")
flags.DEFINE_bool("share_warm_start", True, "Train the IL warm start once per seed for arms differing in RL only.")
flags.DEFINE_string(
    "results", None, "Results files folder; default results/<preset> with a preset that keeps them, '' = none."
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
    try:
        name, preset = (
            resolve_preset(FLAGS.preset, SWEEP_DIR)
            if FLAGS.preset
            else ("custom", Preset(tuple(FLAGS.configs), (0, 1, 2)))
        )
        configs = [resolve_config(c, CONFIG_DIR) for c in preset.configs]
    except ValueError as e:
        raise app.UsageError(f"--{'preset' if FLAGS.preset else 'configs'}: {e}") from None
    if FLAGS.effect is not None:
        try:
            preset = dataclasses.replace(preset, effect=FLAGS.effect)
        except ValueError as e:
            raise app.UsageError(f"--effect: {e}") from None
    overrides = dict(split_override(s) for s in FLAGS.set)
    overrides |= {key: FLAGS[f].value for f, key in SHORTHANDS if FLAGS[f].value is not None}
    quiet_library_logs()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    kept = FLAGS.preset and preset.keep_results
    results = FLAGS.results if FLAGS.results is not None else (os.path.join("results", name) if kept else "")
    if run_preset(
        preset,
        configs,
        tuple(int(s) for s in FLAGS.seeds) if FLAGS.seeds is not None else preset.seeds,
        os.path.abspath(FLAGS.out or os.path.join("runs", "ablations", name)),
        overrides=overrides,
        results=results,
        from_results=FLAGS.from_results,
        reference=FLAGS.reference,
        claim=FLAGS.claim,
        threshold=FLAGS.threshold,
        train_command=[sys.executable, os.path.join(HERE, "train.py")] if FLAGS.isolation == "subprocess" else None,
        rerun=FLAGS.rerun,
        share_warm_start=FLAGS.share_warm_start,
    ):
        sys.exit(1)


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
