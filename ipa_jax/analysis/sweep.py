"""Ablation sweeps: train a set of configs over several seeds, then write the comparison into one folder.

Sweep presets (what to compare) are files of configs/sweeps/ (`ipa_jax.analysis.presets`). Each (config, seed)
trains into <out>/runs/<config>/seed_<seed> with train.seed and train.run_dir set (and the
sweep's overrides applied to every arm); a run whose folder already holds summary.json is reused, so rerunning an
interrupted sweep continues it (`rerun=True` starts the runs afresh), unless its config.json differs from the arm's
config: such a run is recorded as failed with the differing keys, never tabled under the arm's name. Then <out>/
holds ablation.json (what ran, where, what failed), table.md, table.csv, runs.csv and the plots
(`ipa_jax.analysis.tables`): per config the mean over seeds with its confidence interval, and its paired difference
with a reference config (docs/statistics.md).

Shared warm starts: configs that differ only in what the RL phase reads (RL_PHASE_KEYS: the objective, the queue,
the RL learning rate, sampling, the rollout source) have the same IL warm start for a seed, so it is trained once,
in <out>/warm_starts/<its donor>/seed_<seed> (`shared_warm_starts`; train.steps = train.il_warmup_steps: it stops
where RL would start), and each of them resumes from a copy of it (checkpoint, tokenizer, metrics, evaluation
records). Their
comparison is then paired: every arm of a seed starts RL from the same policy, and every run is evaluated on the same
held-out tasks (`ipa_jax.pipeline.evaluation.EVAL_SEED`). A run's wall_time_s is its own process's, the RL phase.

Repeated runs: an arm whose config equals an earlier arm's once settings without effect are left out
(`effective_view`, `same_runs`) is not trained; it takes that arm's run of each seed (manifest["same_as"]).

Isolation: with `train_command` (the argv of the training script, e.g. `python experiments/train.py`) every run is
a fresh process, so runs share no JAX/XLA state, a run that crashes or runs out of memory fails alone and is
recorded while the sweep goes on, and memory does not grow over a long sweep. The processes share a persistent XLA
compilation cache, <out>/xla_cache (JAX_COMPILATION_CACHE_DIR, unless the environment sets it; off with
JAX_ENABLE_COMPILATION_CACHE=false), so a program that several runs build (the engine's, the evaluation's, an arm's
train step in its next seed) compiles once. Without `train_command`, runs train in this process
(`ipa_jax.pipeline.run`: no interpreter and JAX start-up per run; quick sweeps and tests).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ipa_jax.analysis.curves import RunResult
from ipa_jax.analysis.presets import Preset
from ipa_jax.analysis.results import (
    UNFINGERPRINTED,
    fingerprint,
    load_result,
    read_result,
    resolved_config,
    result_changes,
    result_path,
    results_of,
    write_result,
)
from ipa_jax.analysis.stats import CLAIMS, DEFAULT_EFFECT
from ipa_jax.analysis.tables import load_ablation, manifest_comparison, write_plots, write_tables
from ipa_jax.pipeline import ConfigError, RunFolder, load_config, run, validate
from ipa_jax.pipeline.config import flatten
from ipa_jax.pipeline.run import changes_since, describe_changes

log = logging.getLogger(__name__)

NAMING_KEYS = ("train.name", "train.run_dir")  # what a run is called and where it goes, not what it does

# Resolved config keys (prefixes) the IL warm start does not read: arms that differ only in these share it. Before
# rl_start every rollout source serves the same batches, scripted-expert episodes of the one ExpertStream
# (`RolloutSource.next_trajectories` in ipa_jax.pipeline.online), so the source (rollout.source, its resample.*
# settings, rollout.schedule) is an RL-phase choice too.
RL_PHASE_KEYS = (
    "objective.",
    "queue.",
    "resample.",
    "optimizer.lr",
    "rollout.source",
    "rollout.schedule",
    "rollout.temperature",
    "rollout.top_p",
    "rollout.top_k",
    "rollout.group_size",
    "rollout.concurrency",
    "rollout.weight_sync_every",
    "rollout.seed_offset",
    "rollout.expert_successes_only",
    "train.reward_flip_fraction",
    "train.max_consecutive_zero_grad",  # counts RL updates only
    "train.steps",
    "train.eval_every",
    *NAMING_KEYS,
)
WARM_START_FILES = ("checkpoints", "tokenizer", "metrics.jsonl", "trajectories", "samples", "eval_tasks")


def resolve_config(spec: str, config_dir: str) -> tuple[str, str]:
    """(name, absolute path) of a config: a bare name is <config_dir>/<name>.py, anything else a path."""
    spec = spec.strip()
    if not spec:
        raise ValueError("empty config name")
    path = spec if spec.endswith(".py") or os.sep in spec else os.path.join(config_dir, spec + ".py")
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"no config file {path} (for {spec!r})")
    return os.path.splitext(os.path.basename(path))[0], path


def run_overrides(
    run_dir: str, seed: int, overrides: Mapping[str, Any] = (), steps: int | None = None
) -> dict[str, Any]:
    """The dotted config overrides of one (config, seed) run of a sweep (`steps`: a warm start's train.steps)."""
    out = {**dict(overrides), "train.seed": seed, "train.run_dir": run_dir}
    if steps is not None:
        out["train.steps"] = steps
    return out


def resolved_flat(config_path: str, overrides: Mapping[str, Any] = ()) -> dict[str, Any] | None:
    """The resolved config of `config_path` with `overrides` as {dotted key: value}, rollout.source resolved ("auto"
    -> the source the run uses, `ExperimentConfig.online_source`); None when the config does not load (its run
    reports why)."""
    try:
        exp = validate(load_config(config_path, dict(overrides)))
    except Exception:  # noqa: BLE001 - the run itself fails with the config's own error message
        return None
    return {**flatten(exp.to_dict()), "rollout.source": exp.online_source}


def il_phase_key(flat: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """(the `il_phase_view` of a `resolved_flat` as JSON, train.il_warmup_steps), equal for configs whose warm starts
    are the same; None without a warm start or for a config that did not load (None)."""
    if flat is None or not flat["train.il_warmup_steps"]:
        return None
    return json.dumps(il_phase_view(flat), sort_keys=True, default=repr), int(flat["train.il_warmup_steps"])


def warm_start_key(config_path: str, overrides: Mapping[str, Any] = ()) -> tuple[str, int] | None:
    """`il_phase_key` of the config at `config_path` with `overrides`."""
    return il_phase_key(resolved_flat(config_path, overrides))


def shared_warm_starts(
    arms: Sequence[tuple[str, str]], flats: Mapping[str, Mapping[str, Any] | None]
) -> dict[str, tuple[str, str, int]]:
    """{arm: (donor, the donor's config path, IL steps)} for the arms (name, path) whose `il_phase_key` (of their
    `resolved_flat` in `flats`) another arm shares: their warm start is trained once, by the donor, the group's
    first arm (whatever its rollout source: every source resumes from any source's warm start)."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name, _ in arms:
        key = il_phase_key(flats[name])
        if key is not None:
            groups.setdefault(key, []).append(name)
    paths = dict(arms)
    shared = {}
    for (_, warm), names in groups.items():
        if len(names) > 1:
            shared |= {name: (names[0], paths[names[0]], warm) for name in names}
    return shared


def il_phase_view(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a flattened resolved config that its IL warm start reads: all but RL_PHASE_KEYS, and
    optimizer.lr too when optimizer.il_lr is 0 (the warm start then trains at lr)."""
    kept = {k: v for k, v in flat.items() if not k.startswith(RL_PHASE_KEYS)}
    if not flat["optimizer.il_lr"]:
        kept["optimizer.lr"] = flat["optimizer.lr"]
    return kept


def effective_view(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a flattened resolved config (`resolved_flat`) that change what its run does: all but NAMING_KEYS,
    and rollout.expert_successes_only only where it filters something: only the expert source reads it
    (`ExpertSource`), and with env.expert_error 0 no demonstration fails (`expert_errs`)."""
    filters = flat["rollout.source"] == "expert" and flat["env.expert_error"] > 0
    dropped = {*NAMING_KEYS, *(() if filters else ("rollout.expert_successes_only",))}
    return {k: v for k, v in flat.items() if k not in dropped}


def same_runs(flats: Mapping[str, Mapping[str, Any] | None]) -> dict[str, str]:
    """{config: the first config before it (in `flats`' order) with an equal `effective_view`} of configs given
    as {name: `resolved_flat` or None}: such a config's run would repeat that one's, so a sweep takes its result
    instead of training it again. A config that does not load equals none."""
    first: dict[str, str] = {}
    same = {}
    for name, flat in flats.items():
        if flat is None:
            continue
        view = json.dumps(effective_view(flat), sort_keys=True, default=repr)
        if first.setdefault(view, name) != name:
            same[name] = first[view]
    return same


def seed_from_warm_start(warm_dir: str, run_dir: str) -> None:
    """Copies a finished warm start into a fresh run folder, which then resumes from its last checkpoint."""
    for name in WARM_START_FILES:
        src, dst = os.path.join(warm_dir, name), os.path.join(run_dir, name)
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        elif os.path.exists(src):
            shutil.copy2(src, dst)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM (a scheduler's stop, `timeout`) raises SystemExit(143) as Ctrl-C raises
    KeyboardInterrupt, so that cleanup runs (in the main thread, where signal handlers live; elsewhere nothing
    changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def train_one(
    config_path: str,
    overrides: Mapping[str, Any],
    log_path: str,
    train_command: Sequence[str] | None = None,
    xla_cache_dir: str | None = None,
) -> None:
    """One run: `train_command --config=PATH --config.KEY=VALUE ...` as a subprocess (its output to `log_path`;
    with JAX_COMPILATION_CACHE_DIR=`xla_cache_dir` unless the environment sets it), or in this process without a
    command. Raises RuntimeError when the subprocess fails. A Ctrl-C or SIGTERM of the sweep meanwhile stops the
    subprocess too (it saves a checkpoint) before the sweep stops: no run is left training on its own."""
    if train_command is None:
        with open(log_path, "w", encoding="utf-8") as f:
            f.write(f"in-process run of {config_path} with {dict(overrides)}\n")
        run(load_config(config_path, dict(overrides)))
        return
    cmd = [*train_command, f"--config={config_path}", *(f"--config.{k}={v}" for k, v in overrides.items())]
    with open(log_path, "w", encoding="utf-8") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        env = {"JAX_COMPILATION_CACHE_DIR": xla_cache_dir, **os.environ} if xla_cache_dir else None
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        with sigterm_raises():
            try:
                rc = proc.wait()
            except BaseException:  # the sweep is stopping (Ctrl-C, SIGTERM): its run stops too, with a checkpoint
                proc.terminate()
                proc.wait()
                raise
    if rc != 0:
        raise RuntimeError(f"exit status {rc}")


def sweep(
    configs: Sequence[tuple[str, str]],
    seeds: Sequence[int],
    out: str,
    *,
    overrides: Mapping[str, Any] = (),
    threshold: float = 0.5,
    train_command: Sequence[str] | None = None,
    rerun: bool = False,
    share_warm_start: bool = True,
    reference: str | None = None,
    claim: str = "higher",
    controls: Sequence[str] = (),
    effect: float = DEFAULT_EFFECT,
    pairs: Mapping[str, str] | None = None,
    results_dir: str | None = None,
    claims: Sequence[str] = (),
    aa_controls: Sequence[str] = (),
) -> dict[str, Any]:
    """Trains every (config, seed) with `overrides` on every arm (a line per run as it starts), seed by seed with
    the arms of a seed interleaved (`run_order`), then writes the tables (and prints the Markdown one) and the plots
    into `out`: differences against `reference` (default the first config; `pairs`: {config: its own reference}),
    verdicts on `claim` ("higher": each config beats the reference; "lower": the reference beats it) over the
    pre-registered `claims` (the Holm family; empty: every config but the controls), positive `controls` checked for
    detection, `aa_controls` for an interval that covers 0, seeds stated for the `effect` of interest. With
    `results_dir`, every finished run's results file goes there (`ipa_jax.analysis.results`), a run whose folder is
    gone is taken from its results file when that matches the arm's config, and the tables are built from the
    results files. An arm whose `effective_view` equals an earlier arm's (`same_runs`) is not trained: it takes that
    arm's run of each seed (its results file written under its own name; manifest["same_as"]: {arm: that arm}).
    Returns the manifest (also <out>/ablation.json, rewritten after every run so a partial sweep is readable)."""
    if not configs or not seeds:
        raise ValueError("nothing to run: need at least one config and one seed")
    names = [name for name, _ in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"two configs share a name: {names}")
    reference = names[0] if reference is None else reference
    if reference not in names:
        raise ValueError(f"reference {reference!r} is not one of the configs {names}")
    if claim not in CLAIMS:
        raise ValueError(f"claim must be one of {CLAIMS}, got {claim!r}")
    pairs = dict(pairs or {})
    unknown = {k: v for k, v in pairs.items() if k not in names or v not in names}
    if unknown:
        raise ValueError(f"pairs {unknown} must map configs to configs of {names}")
    overrides = dict(overrides)
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    manifest: dict[str, Any] = {
        "configs": dict(configs),
        "seeds": list(seeds),
        "overrides": overrides,
        "threshold": threshold,
        "reference": reference,
        "claim": claim,
        "controls": list(controls),
        "claims": list(claims),
        "aa_controls": list(aa_controls),
        "effect": effect,
        "pairs": pairs,
        "results_dir": results_dir,
        "isolation": "subprocess" if train_command else "inprocess",
        "runs": {},
        "failed": [],
        "wall_time_s": {},
        "warm_starts": {},
        "results": {},
        "order": [],
    }
    # Arms whose runs would repeat an earlier arm's take its result (same_runs), after the seed's own runs.
    paths = dict(configs)
    flats = {name: resolved_flat(path, overrides) for name, path in configs}
    same_as = manifest["same_as"] = same_runs(flats)
    trained_arms = [(name, path) for name, path in configs if name not in same_as]
    shared = shared_warm_starts(trained_arms, flats) if share_warm_start else {}
    # Seed-major order: after the first len(configs) runs every config has one seed, so a partial sweep compares.
    progress = SweepProgress(len(configs) * len(seeds))
    finished: dict[tuple[str, int], tuple[RunResult, str | None]] = {}  # (arm, seed) -> (result, its run folder)
    for index, seed in enumerate(seeds):
        for name, path in [*run_order(trained_arms, index), *((name, paths[name]) for name in same_as)]:
            manifest["order"].append([name, seed])
            run_dir = os.path.join(out, "runs", name, f"seed_{seed}")
            rel = os.path.relpath(run_dir, out)
            results_file = result_path(results_dir, name, seed) if results_dir else None
            if rerun and os.path.isdir(run_dir):
                shutil.rmtree(run_dir)
            trained = False
            t0 = time.perf_counter()
            try:
                resolved = resolved_config(path, run_overrides(run_dir, seed, overrides)) if results_dir else {}
                if name in same_as:
                    if (same_as[name], seed) not in finished:
                        raise RuntimeError(f"the run of {same_as[name]} (the same effective config) did not finish")
                    result, folder = finished[same_as[name], seed]
                else:
                    if RunFolder(run_dir).has_summary():
                        check_finished(path, run_overrides(run_dir, seed, overrides), run_dir)
                    elif not rerun and results_file and os.path.exists(results_file):
                        check_result(results_file, resolved, path)
                    else:
                        trained = True
                        try:
                            _train_run(
                                name,
                                path,
                                seed,
                                run_dir,
                                out,
                                overrides,
                                shared.get(name),
                                manifest,
                                rerun,
                                train_command,
                            )
                        finally:
                            manifest["wall_time_s"][rel] = time.perf_counter() - t0
                    folder = rel if RunFolder(run_dir).has_summary() else None
                    result = RunResult.from_run(run_dir) if folder else load_result(results_file)
                    finished[name, seed] = result, folder
                if folder:
                    manifest["runs"].setdefault(name, []).append(folder)
                if results_file:
                    if folder or name in same_as:  # (a result read from its own file is there already)
                        write_result(results_file, result, name, resolved)
                    manifest["results"].setdefault(name, []).append(os.path.relpath(results_file, out))
                outcome = (
                    run_outcome(result, reused=False) + f" (the run of {same_as[name]}: the same effective config)"
                    if name in same_as
                    else run_outcome(result, reused=not trained)
                )
            except Exception as e:  # one failed run must not lose the rest of the sweep: record it, go on
                log.debug("%s seed %d failed", name, seed, exc_info=True)
                manifest["failed"].append(
                    {
                        "config": name,
                        "seed": seed,
                        "run_dir": rel,
                        "error": repr(e),
                        "traceback": traceback.format_exc(),
                    }
                )
                outcome = f"FAILED: {e} (log: {run_dir}/ablate.log)"
            progress.finished(name, seed, outcome, time.perf_counter() - t0 if trained else None)
            _write_manifest(out, manifest)
    for key in ("runs", "results"):  # in config order, whatever order they ran in
        manifest[key] = {name: sorted(manifest[key][name]) for name, _ in configs if name in manifest[key]}
    _write_manifest(out, manifest)
    tabled = manifest["results"] if results_dir else manifest["runs"]
    print(
        f"{sum(map(len, tabled.values()))} runs finished, {len(manifest['failed'])} failed, "
        f"{minutes(progress.elapsed())}; table, plots and runs in {out}",
        flush=True,
    )
    if not tabled:
        raise RuntimeError(f"every run failed; see {out}/ablation.json and the ablate.log files")
    loaded = load_ablation(out)
    write_ablation_tables(out, loaded, threshold)
    try:
        if loaded["runs"]:
            write_plots(out, loaded["runs"])
    except ImportError as e:  # the table is written; plots need matplotlib
        log.warning("plots skipped (%s): pip install matplotlib, then rerun the same command", e)
    return manifest


def run_preset(
    preset: Preset,
    configs: Sequence[tuple[str, str]],
    seeds: Sequence[int],
    out: str,
    *,
    overrides: Mapping[str, Any] = (),
    results: str | None = None,
    from_results: bool = False,
    reference: str | None = None,
    claim: str | None = None,
    threshold: float = 0.5,
    train_command: Sequence[str] | None = None,
    rerun: bool = False,
    share_warm_start: bool = True,
) -> bool:
    """Every condition of `preset` in turn (<out>/<condition>, <results>/<condition>): its `sweep` of the resolved
    `configs` (name, path) over `seeds` with the preset's overrides, the condition's, then `overrides`; or, with
    `from_results`, its tables rebuilt from the results files alone. `reference` and `claim` default to the
    preset's. Returns whether any run failed. ConfigError for a reference that is not one of the configs, and
    with from_results for a missing results folder or file."""
    names = [name for name, _ in configs]
    name_of = dict(zip(preset.configs, names))  # a preset may name its configs by path
    reference = reference if reference is not None else name_of.get(preset.reference)
    if reference is not None and reference not in names:
        raise ConfigError("reference", f"must be one of the configs ({', '.join(names)}), got {reference!r}")
    if from_results and not results:
        raise ConfigError("results", "--from_results needs the folder of the results files")
    pairs = {name_of[config]: name_of[other] for config, other in preset.pairs}

    def compared(specs: Sequence[str]) -> list[str]:  # their names, those still compared under `reference`
        return [name_of[c] for c in specs if name_of[c] != pairs.get(name_of[c], reference or names[0])]

    comparison = dict(
        threshold=threshold,
        reference=reference,
        claim=claim or preset.claim,
        controls=compared(preset.controls),
        claims=compared(preset.claims),
        aa_controls=compared(preset.aa_controls),
        effect=preset.effect,
        pairs=pairs,
    )
    failed = False
    for condition, condition_overrides in preset.conditions or (("", ()),):
        where = os.path.join(out, condition) if condition else out
        results_dir = os.path.abspath(os.path.join(results, condition)) if results else None
        settings = dict(preset.overrides) | dict(condition_overrides) | dict(overrides)
        if condition:
            print(f"condition {condition}: {dict(condition_overrides)}", flush=True)
        if from_results:
            same_as = same_runs({name: resolved_flat(path, settings) for name, path in configs})
            try:
                tables_from_results(names, seeds, results_dir, where, same_as=same_as, **comparison)
            except FileNotFoundError as e:
                raise ConfigError("results", f"{e}; run the sweep first (without --from_results)") from None
            continue
        manifest = sweep(
            configs,
            seeds,
            where,
            overrides=settings,
            train_command=train_command,
            rerun=rerun,
            share_warm_start=share_warm_start,
            results_dir=results_dir,
            **comparison,
        )
        failed = failed or bool(manifest["failed"])
    return failed


def run_order(configs: Sequence[tuple[str, str]], index: int) -> list[tuple[str, str]]:
    """The arms of the `index`-th seed, rotated by `index`: over len(configs) seeds every arm runs once in every
    position of a seed's runs, so a machine's load (other work, a slower hour) hits the arms alike."""
    k = index % len(configs)
    return [*configs[k:], *configs[:k]]


def check_result(results_file: str, resolved: Mapping[str, Any], config_path: str) -> None:
    """Raises ConfigError when a results file was written by another config than the arm's `resolved` one
    (`result_changes`: keys added since at their defaults aside), naming the keys that differ."""
    _, head = read_result(results_file)
    if head["config_sha"] == fingerprint(resolved):
        return
    stored = head["config_resolved"]
    changes = result_changes(stored, resolved) if stored is not None else None
    if changes == {}:
        log.info("%s: the arm's config, with the keys added since at their defaults", results_file)
        return
    key, differs = (
        ("", f"config_sha {head['config_sha']} != {fingerprint(resolved)}")
        if changes is None
        else (next(iter(changes)), ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()))
    )
    raise ConfigError(
        key,
        f"{results_file} was written by a different config than {config_path} ({differs}); retrain it with "
        "--rerun or remove the file",
    )


def write_ablation_tables(out: str, manifest: dict[str, Any], threshold: float) -> None:
    """table.md, table.csv and runs.csv of an ablation folder's manifest (`load_ablation`): from its results files
    when it has them, else its run folders; prints table.md."""
    runs = manifest.get("results") or manifest["runs"]
    comparison = manifest_comparison(manifest)
    if (reference := comparison["reference"]) != manifest.get("reference"):
        log.warning("%s has no finished run: differences are taken against %s", manifest.get("reference"), reference)
    write_tables(out, runs, threshold, **comparison)
    with open(os.path.join(out, "table.md"), encoding="utf-8") as f:
        print(f.read(), flush=True)  # before the plots: a plotting failure loses nothing


def tables_from_results(
    configs: Sequence[str],
    seeds: Sequence[int],
    results_dir: str,
    out: str,
    *,
    threshold: float = 0.5,
    reference: str | None = None,
    claim: str = "higher",
    controls: Sequence[str] = (),
    effect: float = DEFAULT_EFFECT,
    pairs: Mapping[str, str] | None = None,
    claims: Sequence[str] = (),
    aa_controls: Sequence[str] = (),
    same_as: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The tables of a sweep rebuilt from its results files alone (no run folder, nothing trained): the results of
    `configs` x `seeds` under `results_dir`, written into `out` with an ablation.json naming them (and the
    comparison's settings, as `sweep` writes them). Returns that manifest; FileNotFoundError when no results file
    exists."""
    found = results_of(results_dir, list(configs), list(seeds))
    if not found:
        raise FileNotFoundError(f"no results files of {list(configs)} under {os.path.abspath(results_dir)}")
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    manifest = {
        "configs": {name: name for name in configs},
        "seeds": list(seeds),
        "threshold": threshold,
        "reference": reference or configs[0],
        "claim": claim,
        "controls": list(controls),
        "claims": list(claims),
        "aa_controls": list(aa_controls),
        "effect": effect,
        "pairs": dict(pairs or {}),
        "same_as": dict(same_as or {}),
        "results_dir": os.path.abspath(results_dir),
        "runs": {},
        "results": {name: [os.path.relpath(p, out) for p in paths] for name, paths in found.items()},
        "failed": [],
    }
    _write_manifest(out, manifest)
    missing = [(c, s) for c in configs for s in seeds if not os.path.exists(result_path(results_dir, c, s))]
    if missing:
        log.warning("no results file for %d runs (the tables leave them out): %s", len(missing), missing[:8])
    write_ablation_tables(out, load_ablation(out), threshold)
    return manifest


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def run_outcome(result: RunResult, reused: bool) -> str:
    """A finished run in a few words: its held-out success after the warm start and at the end."""
    return f"held-out success {100 * result.success_before:.1f}% -> {100 * result.success_after:.1f}%" + (
        " (finished earlier)" if reused else ""
    )


class SweepProgress:
    """One console line per finished run: which, how it ended, its time, and the sweep's progress with the time
    left at the mean time of the runs trained so far."""

    def __init__(self, total: int):
        self.total, self.done, self._start, self._trained_s = total, 0, time.perf_counter(), []

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def finished(self, name: str, seed: int, outcome: str, seconds: float | None) -> None:
        self.done += 1
        if seconds is not None:
            self._trained_s.append(seconds)
        took = f" in {minutes(seconds)}" if seconds is not None else ""
        left = (
            f", about {minutes(sum(self._trained_s) / len(self._trained_s) * (self.total - self.done))} left"
            if self._trained_s and self.done < self.total
            else ""
        )
        print(
            f"[{self.done}/{self.total}] {name} seed {seed}: {outcome}{took} ({minutes(self.elapsed())} elapsed{left})",
            flush=True,
        )


def check_finished(config_path: str, overrides: Mapping[str, Any], run_dir: str, il_phase_only: bool = False) -> None:
    """Raises ConfigError when the finished run in `run_dir` was trained with another config than `config_path`
    with `overrides` (a config file edited since, or another file of the same name): reusing it would put a
    different experiment in the table under this name (keys that cannot change what it computed, UNFINGERPRINTED,
    aside). `il_phase_only`: a warm start, compared on the keys its IL phase read (il_phase_view)."""
    exp = validate(load_config(config_path, dict(overrides)))
    changes = {k: v for k, v in changes_since(exp, RunFolder(run_dir)).items() if k not in UNFINGERPRINTED}
    if il_phase_only:
        read = il_phase_view(flatten(exp.to_dict()))
        changes = {k: v for k, v in changes.items() if k in read}
    if changes:
        raise ConfigError(
            next(iter(changes)),
            f"{run_dir} finished with a different config than {config_path} "
            f"({describe_changes(changes)}); retrain it with --rerun or remove the folder",
        )


def _train_run(
    name: str,
    path: str,
    seed: int,
    run_dir: str,
    out: str,
    overrides: Mapping[str, Any],
    warm_start: tuple[str, str, int] | None,
    manifest: dict[str, Any],
    rerun: bool,
    train_command: Sequence[str] | None,
) -> None:
    """Trains one (config, seed) of a sweep into `run_dir`; with `warm_start` = (donor config name, its path, IL
    steps), from that shared warm start (trained here first when missing, recorded in manifest["warm_starts"])."""
    os.makedirs(run_dir, exist_ok=True)
    xla_cache = os.path.join(out, "xla_cache")
    print(f"[{time.strftime('%H:%M:%S')}] training {name} seed {seed} -> {run_dir}", flush=True)
    if warm_start is not None and not os.path.exists(RunFolder(run_dir).checkpoints_dir):
        donor, donor_path, warm = warm_start
        warm_dir = os.path.join(out, "warm_starts", donor, f"seed_{seed}")
        warm_overrides = run_overrides(warm_dir, seed, overrides, steps=warm)
        # --rerun trains it again once, before the first of its arms in this sweep (whichever runs first) uses it
        if rerun and os.path.isdir(warm_dir) and os.path.relpath(warm_dir, out) not in manifest["warm_starts"].values():
            shutil.rmtree(warm_dir)
        if RunFolder(warm_dir).has_summary():
            check_finished(donor_path, warm_overrides, warm_dir, il_phase_only=True)
        else:
            os.makedirs(warm_dir, exist_ok=True)
            print(f"[{time.strftime('%H:%M:%S')}] IL warm start of {donor} seed {seed} -> {warm_dir}", flush=True)
            train_one(donor_path, warm_overrides, os.path.join(warm_dir, "ablate.log"), train_command, xla_cache)
        seed_from_warm_start(warm_dir, run_dir)
        manifest["warm_starts"][os.path.relpath(run_dir, out)] = os.path.relpath(warm_dir, out)
    train_one(
        path, run_overrides(run_dir, seed, overrides), os.path.join(run_dir, "ablate.log"), train_command, xla_cache
    )


def _write_manifest(out: str, manifest: dict[str, Any]) -> None:
    tmp = os.path.join(out, "ablation.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(out, "ablation.json"))
