"""Run a set of ablation configs over several seeds, then write a comparison table and plots into one folder.

    python experiments/ablate.py --preset=small                      # -> runs/ablations/small/
    python experiments/ablate.py --preset=credit --seeds=0,1,2 --out=runs/ablations/credit
    python experiments/ablate.py --configs=credit_chunk,configs/ablations/credit_token.py --seeds=0,1 --steps=20 \\
        --out=runs/ablations/mine

Configs are named by file (`credit_token` = configs/ablations/credit_token.py) or given as paths. Each (config,
seed) trains into <out>/runs/<config>/seed_<seed> with train.seed, train.run_dir (and --steps) overridden; a run
whose folder already holds summary.json is reused (rerun an interrupted sweep with the same command; --rerun
starts the runs afresh). Then <out>/ holds ablation.json (what ran, where, what failed), table.md, table.csv
(final held-out success, area under the success curve, steps to --threshold success, wall time, admitted
fraction: mean ± std over seeds), runs.csv (per run) and eval_success.png, train_reward.png,
admitted_fraction.png (mean ± std bands over seeds). notebooks/ablations.ipynb reads the same folder.

Shared warm starts: configs that differ only in what the RL phase reads (RL_PHASE_KEYS: the objective, the queue,
the RL learning rate, sampling) have the same IL warm start for a seed, so it is trained once, in
<out>/warm_starts/<first such config>/seed_<seed> (train.steps = train.il_warmup_steps: it stops where RL would
start), and each of them resumes from a copy of it (checkpoint, tokenizer, metrics). Their comparison is then
paired: every arm starts RL from the same policy. A run's wall_time_s is its own process's, the RL phase;
--noshare_warm_start trains every run from scratch.

Isolation: by default every run is a fresh `python experiments/train.py` process (the same command a user types),
so runs share no JAX/XLA state (compiled functions, device buffers, engine threads of the previous run), a run that
crashes or runs out of memory fails alone and is recorded while the sweep goes on, and memory does not grow over a
long sweep. --isolation=inprocess calls experiments.train.run(config) in this process instead (no interpreter and
JAX start-up per run; for quick sweeps and tests).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python experiments/ablate.py` from anywhere: the repo root must be importable
    sys.path.insert(0, ROOT)

from experiments import analysis  # noqa: E402

ABLATION_CONFIG_DIR = os.path.join(ROOT, "configs", "ablations")
log = logging.getLogger("ablate")


# Resolved config keys (prefixes) the IL warm start does not read: arms that differ only in these share it.
RL_PHASE_KEYS = ("objective.", "queue.", "optimizer.lr", "rollout.temperature", "rollout.top_p", "rollout.top_k",
                 "rollout.group_size", "rollout.concurrency", "rollout.weight_sync_every", "train.steps",
                 "train.eval_every", "train.name", "train.run_dir")
WARM_START_FILES = ("checkpoints", "tokenizer", "metrics.jsonl", "trajectories", "samples")


@dataclass(frozen=True)
class Preset:
    configs: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int | None = None  # None = each config's train.steps
    description: str = ""


PRESETS: dict[str, Preset] = {
    "small": Preset(("credit_chunk", "credit_token"), (0, 1),
                    description="chunk vs token credit, 2 seeds: a sweep that finishes on 2 CPU cores in < 1 h"),
    "claims": Preset(("credit_chunk", "credit_token", "agg_token_mean", "lag4", "lag4_tr"), (0, 1),
                     description="the README's table: chunk vs token credit, sample- vs token-mean, the trust "
                                 "region at policy lag 4 (credit_chunk is the base), 2 seeds, shared warm starts"),
    "credit": Preset(("credit_chunk", "credit_token", "credit_trajectory"), (0, 1, 2),
                     description="IPA's claim: chunk-level credit beats token-level (and trajectory-level)"),
    "staleness": Preset(("lag4", "lag4_tr", "lag8", "lag8_tr"), (0, 1, 2),
                        description="FlashREINFORCE's claim: the sequence trust region keeps stale updates stable"),
    "aggregation": Preset(("agg_sample_mean", "agg_token_mean", "agg_chunk_mean"), (0, 1, 2),
                          description="FlashREINFORCE's claim: sample-mean beats token-mean aggregation"),
}


def resolve_config(spec: str) -> tuple[str, str]:
    """(name, absolute path) of a config: a bare name is configs/ablations/<name>.py, anything else a path."""
    spec = spec.strip()
    if not spec:
        raise ValueError("--configs: empty config name")
    path = spec if spec.endswith(".py") or os.sep in spec else os.path.join(ABLATION_CONFIG_DIR, spec + ".py")
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"--configs: no config file {path} (for {spec!r})")
    return os.path.splitext(os.path.basename(path))[0], path


def run_overrides(run_dir: str, seed: int, steps: int | None) -> dict[str, Any]:
    """The dotted config overrides that make one (config, seed) run of a sweep."""
    overrides: dict[str, Any] = {"train.seed": seed, "train.run_dir": run_dir}
    if steps is not None:
        overrides["train.steps"] = steps
    return overrides


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A resolved config as {dotted key: value} (model.arch and env.kwargs stay whole dicts)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("arch", "kwargs"):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def warm_start_key(config_path: str) -> tuple[str, int] | None:
    """(the config without its RL_PHASE_KEYS as JSON, train.il_warmup_steps), equal for configs whose warm
    starts are the same; None without a warm start or when the config does not load (its run reports why)."""
    from ipa_jax.config import load_config, resolved_dict

    try:
        flat = _flatten(resolved_dict(load_config(config_path)))
    except Exception:  # noqa: BLE001 - the run itself fails with the config's own error message
        return None
    warm = int(flat["train.il_warmup_steps"])
    if warm == 0:
        return None
    kept = {k: v for k, v in flat.items() if not k.startswith(RL_PHASE_KEYS)}
    return json.dumps(kept, sort_keys=True, default=repr), warm


def seed_from_warm_start(warm_dir: str, run_dir: str) -> None:
    """Copies a finished warm start into a fresh run folder, which then resumes from its last checkpoint."""
    for name in WARM_START_FILES:
        src, dst = os.path.join(warm_dir, name), os.path.join(run_dir, name)
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        elif os.path.exists(src):
            shutil.copy2(src, dst)


def _run_subprocess(config_path: str, overrides: dict[str, Any], log_path: str) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), f"--config={config_path}"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    with open(log_path, "w", encoding="utf-8") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        raise RuntimeError(f"exit status {rc}")


def _run_inprocess(config_path: str, overrides: dict[str, Any], log_path: str) -> None:
    from experiments.train import run
    from ipa_jax.config import load_config

    with open(log_path, "w", encoding="utf-8") as f:
        f.write(f"in-process run of {config_path} with {overrides}\n")
    run(load_config(config_path, overrides))


RUNNERS = {"subprocess": _run_subprocess, "inprocess": _run_inprocess}


def sweep(configs: Sequence[tuple[str, str]], seeds: Sequence[int], out: str, *, steps: int | None = None,
          threshold: float = 0.5, isolation: str = "subprocess", rerun: bool = False,
          share_warm_start: bool = True) -> dict[str, Any]:
    """Trains every (config, seed) in order, then writes the table and plots into `out`. Returns the manifest
    (also <out>/ablation.json, rewritten after every run so a partial sweep is readable)."""
    if isolation not in RUNNERS:
        raise ValueError(f"--isolation must be one of {sorted(RUNNERS)}, got {isolation!r}")
    if not configs or not seeds:
        raise ValueError("nothing to run: need at least one config and one seed")
    names = [name for name, _ in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"--configs: two configs share a name: {names}")
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    manifest: dict[str, Any] = {
        "configs": dict(configs), "seeds": list(seeds), "steps": steps, "threshold": threshold,
        "isolation": isolation, "runs": {}, "failed": [], "wall_time_s": {}, "warm_starts": {},
    }
    # Configs with the same warm start (module doc): the first of each group trains it for all.
    donors: dict[tuple[str, int], str] = {}
    shared: dict[str, tuple[str, int]] = {}
    if share_warm_start:
        keys = {name: warm_start_key(path) for name, path in configs}
        for name, _ in configs:
            if keys[name] is not None and sum(k == keys[name] for k in keys.values()) > 1:
                donors.setdefault(keys[name], name)
                shared[name] = (donors[keys[name]], keys[name][1])
    paths = dict(configs)
    # Seed-major order: after the first len(configs) runs every config has one seed, so a partial sweep compares.
    for seed in seeds:
        for name, path in configs:
            run_dir = os.path.join(out, "runs", name, f"seed_{seed}")
            rel = os.path.relpath(run_dir, out)
            if rerun and os.path.isdir(run_dir):
                shutil.rmtree(run_dir)
            if not os.path.exists(os.path.join(run_dir, "summary.json")):
                os.makedirs(run_dir, exist_ok=True)
                log.info("training %s seed %d -> %s", name, seed, run_dir)
                t0 = time.perf_counter()
                try:
                    if name in shared and not os.path.exists(os.path.join(run_dir, "checkpoints")):
                        donor, warm = shared[name]
                        warm_dir = os.path.join(out, "warm_starts", donor, f"seed_{seed}")
                        if rerun and os.path.isdir(warm_dir) and name == donor:
                            shutil.rmtree(warm_dir)
                        if not os.path.exists(os.path.join(warm_dir, "summary.json")):
                            os.makedirs(warm_dir, exist_ok=True)
                            log.info("IL warm start of %s seed %d -> %s", donor, seed, warm_dir)
                            RUNNERS[isolation](paths[donor], run_overrides(warm_dir, seed, warm),
                                               os.path.join(warm_dir, "ablate.log"))
                        seed_from_warm_start(warm_dir, run_dir)
                        manifest["warm_starts"][rel] = os.path.relpath(warm_dir, out)
                    RUNNERS[isolation](path, run_overrides(run_dir, seed, steps), os.path.join(run_dir, "ablate.log"))
                except Exception as e:  # one failed run must not lose the rest of the sweep: record it, go on
                    log.error("%s seed %d failed: %s (log: %s/ablate.log)", name, seed, e, run_dir)
                    manifest["failed"].append({"config": name, "seed": seed, "run_dir": rel, "error": repr(e),
                                               "traceback": traceback.format_exc()})
                manifest["wall_time_s"][rel] = time.perf_counter() - t0
            if os.path.exists(os.path.join(run_dir, "summary.json")):
                manifest["runs"].setdefault(name, []).append(rel)
            _write_manifest(out, manifest)
    manifest["runs"] = {name: manifest["runs"][name] for name, _ in configs if name in manifest["runs"]}
    _write_manifest(out, manifest)
    if not manifest["runs"]:
        raise RuntimeError(f"every run failed; see {out}/ablation.json and the ablate.log files")
    runs = analysis.load_ablation(out)["runs"]
    analysis.write_tables(out, runs, threshold)
    analysis.write_plots(out, runs)
    return manifest


def _write_manifest(out: str, manifest: dict[str, Any]) -> None:
    tmp = os.path.join(out, "ablation.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(out, "ablation.json"))


flags.DEFINE_string("preset", None, f"A named set of configs and seeds: {', '.join(PRESETS)}.")
flags.DEFINE_list("configs", None, "Comma-separated configs: names in configs/ablations/ or paths to .py files.")
flags.DEFINE_list("seeds", None, "Comma-separated seeds (default: the preset's; 0,1,2 with --configs).")
flags.DEFINE_string("out", None, "Output folder (run folders, table, plots); default runs/ablations/<preset>.")
flags.DEFINE_integer("steps", None, "Override train.steps of every config (default: the preset's or the config's).")
flags.DEFINE_float("threshold", 0.5, "Held-out success for the 'steps to threshold' column.")
flags.DEFINE_enum("isolation", "subprocess", list(RUNNERS), "One process per run, or all runs in this process.")
flags.DEFINE_bool("rerun", False, "Delete and retrain runs that already finished in --out.")
flags.DEFINE_bool("share_warm_start", True, "Train the IL warm start once per seed for configs that differ only in "
                  "the RL phase, and start each of them from it.")
FLAGS = flags.FLAGS


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if (FLAGS.preset is None) == (FLAGS.configs is None):
        raise app.UsageError("give exactly one of --preset or --configs")
    if FLAGS.preset is not None:
        if FLAGS.preset not in PRESETS:
            raise app.UsageError(f"--preset must be one of {sorted(PRESETS)}, got {FLAGS.preset!r}")
        preset = PRESETS[FLAGS.preset]
    else:
        preset = Preset(tuple(FLAGS.configs), (0, 1, 2))
    seeds = tuple(int(s) for s in FLAGS.seeds) if FLAGS.seeds is not None else preset.seeds
    steps = FLAGS.steps if FLAGS.steps is not None else preset.steps
    configs = [resolve_config(c) for c in preset.configs]
    out = os.path.abspath(FLAGS.out or os.path.join(ROOT, "runs", "ablations", FLAGS.preset or "custom"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.perf_counter()
    manifest = sweep(configs, seeds, out, steps=steps, threshold=FLAGS.threshold, isolation=FLAGS.isolation,
                     rerun=FLAGS.rerun, share_warm_start=FLAGS.share_warm_start)
    with open(os.path.join(out, "table.md"), encoding="utf-8") as f:
        print(f.read())
    print(f"{sum(map(len, manifest['runs'].values()))} runs finished, {len(manifest['failed'])} failed, "
          f"{time.perf_counter() - t0:.0f} s; table, plots and runs in {out}")
    if manifest["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
