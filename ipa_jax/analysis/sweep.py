"""Ablation sweeps: train a set of configs over several seeds, then write the comparison into one folder.

Each (config, seed) trains into <out>/runs/<config>/seed_<seed> with train.seed and train.run_dir set (and the
sweep's overrides applied to every arm); a run whose folder already holds summary.json is reused, so rerunning an
interrupted sweep continues it (`rerun=True` starts the runs afresh), unless its config.json differs from the arm's
config: such a run is recorded as failed with the differing keys, never tabled under the arm's name. Then <out>/
holds ablation.json (what ran, where, what failed), table.md, table.csv, runs.csv and the plots
(`ipa_jax.analysis.tables`): per config the mean over seeds with its confidence interval, and its paired difference
with a reference config (docs/statistics.md).

Shared warm starts: configs that differ only in what the RL phase reads (RL_PHASE_KEYS: the objective, the queue,
the RL learning rate, sampling) have the same IL warm start for a seed, so it is trained once, in
<out>/warm_starts/<first such config>/seed_<seed> (train.steps = train.il_warmup_steps: it stops where RL would
start), and each of them resumes from a copy of it (checkpoint, tokenizer, metrics, evaluation records). Their
comparison is then paired: every arm of a seed starts RL from the same policy, and every run is evaluated on the same
held-out tasks (`ipa_jax.pipeline.evaluation.EVAL_SEED`). A run's wall_time_s is its own process's, the RL phase.

Isolation: with `train_command` (the argv of the training script, e.g. `python experiments/train.py`) every run is
a fresh process, so runs share no JAX/XLA state, a run that crashes or runs out of memory fails alone and is
recorded while the sweep goes on, and memory does not grow over a long sweep. The processes share a persistent XLA
compilation cache, <out>/xla_cache (JAX_COMPILATION_CACHE_DIR, unless the environment sets it; off with
JAX_ENABLE_COMPILATION_CACHE=false), so a program that several runs build (the engine's, the evaluation's, an arm's
train step in its next seed) compiles once. Without `train_command`, runs train in this process
(`ipa_jax.pipeline.run`: no interpreter and JAX start-up per run; quick sweeps and tests).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ipa_jax.analysis.stats import CLAIMS
from ipa_jax.analysis.tables import ablation_reference, load_ablation, write_plots, write_tables
from ipa_jax.pipeline import ConfigError, RunFolder, load_config, run, validate
from ipa_jax.pipeline.config import flatten
from ipa_jax.pipeline.run import changes_since, describe_changes

log = logging.getLogger(__name__)

# Resolved config keys (prefixes) the IL warm start does not read: arms that differ only in these share it.
RL_PHASE_KEYS = ("objective.", "queue.", "optimizer.lr", "rollout.temperature", "rollout.top_p", "rollout.top_k",
                 "rollout.group_size", "rollout.concurrency", "rollout.weight_sync_every", "train.steps",
                 "train.eval_every", "train.name", "train.run_dir")
WARM_START_FILES = ("checkpoints", "tokenizer", "metrics.jsonl", "trajectories", "samples", "eval_tasks")


@dataclass(frozen=True)
class Preset:
    """A named sweep: config names (files of the ablation config folder), seeds, overrides for every arm, and the
    paired comparison its table reports (`reference`: default the first config; `claim`: see CLAIMS)."""

    configs: tuple[str, ...]
    seeds: tuple[int, ...]
    description: str = ""
    overrides: tuple[tuple[str, Any], ...] = ()
    reference: str | None = None
    claim: str = "higher"

    def __post_init__(self) -> None:
        if self.reference is not None and self.reference not in self.configs:
            raise ValueError(f"reference {self.reference!r} is not one of the configs {self.configs}")
        if self.claim not in CLAIMS:
            raise ValueError(f"claim must be one of {', '.join(CLAIMS)}, got {self.claim!r}")


LONGHORIZON_ARMS = ("longhorizon_credit_chunk", "longhorizon_control_il_continue", "longhorizon_credit_token",
                    "longhorizon_credit_token_matched")
LONGHORIZON_FLASH_ARMS = ("longhorizon_flash_reinforce", "longhorizon_flash_token_mean")
# kv_chain with each chain drawn from 1-6 hops (the expert's episodes too) and a 600-step imitation cap: the warm
# start that leaves every seed of 0-3 above 0% held-out success (fixed six hops leave seeds 2 and 3 at 0%).
MIXED_HOPS = (("env.kwargs.min_hops", 1), ("train.il_warmup_steps", 600), ("train.steps", 680))

PRESETS: dict[str, Preset] = {
    "small": Preset(("credit_chunk", "credit_token"), (0, 1),
                    "chunk vs token credit, 2 seeds: a sweep that finishes on 2 CPU cores in < 1 h", claim="lower"),
    "claims": Preset(("credit_chunk", "control_il_continue", "credit_token", "credit_token_matched"), (0, 1, 2, 3),
                     "the README's headline table: IPA (chunk credit) against imitation continued for as many "
                     "updates, token credit, and token credit with the early turns' weight matched; 4 seeds, shared "
                     "warm starts, each arm paired with credit_chunk", reference="credit_chunk", claim="lower"),
    "credit": Preset(("credit_chunk", "credit_token", "credit_trajectory"), (0, 1, 2),
                     "IPA's claim: chunk-level credit beats token-level (and trajectory-level)", claim="lower"),
    "staleness": Preset(("lag4", "lag4_tr", "lag8", "lag8_tr"), (0, 1, 2),
                        "FlashREINFORCE's claim: the sequence trust region keeps stale updates stable"),
    "aggregation": Preset(("agg_sample_mean", "agg_token_mean", "agg_chunk_mean"), (0, 1, 2),
                          "FlashREINFORCE's claim: sample-mean beats token-mean aggregation", claim="lower"),
    "negatives": Preset(("is_chunk", "is_none", "is_token", "is_sequence", "trunc_neg_off"), (0, 1, 2, 3),
                        "IPA's negative branch (batch-mean baseline): its chunk-level ratio on negatives, truncated "
                        "at 1, against no ratio, token- and sequence-level ratios, and no truncation",
                        claim="lower"),
    "negatives_lag4": Preset(("is_chunk", "is_none", "trunc_neg_off", "is_token", "is_sequence"), (0, 1, 2, 3),
                             "the negative branch where its ratios matter: at policy lag ~1 they stay within 4e-4 of "
                             "1, so here the sampler is forced 4 updates behind; IPA's chunk-level ratio on "
                             "negatives, truncated at 1, against no ratio, no truncation, and token- and "
                             "sequence-level ratios",
                             overrides=(("queue.forced_lag", 4), ("queue.max_policy_lag", 6)), claim="lower"),
    "flash": Preset(("flash_reinforce", "flash_tr_off", "flash_token_mean"), (0, 1, 2, 3),
                    "FlashREINFORCE's parts on its own objective (negatives' base): without the sequence trust "
                    "region, token-mean instead of sample-mean aggregation; each paired with the full objective",
                    claim="lower"),
    "flash_entropy": Preset(("flash_reinforce", "flash_entropy_q05"), (0, 1, 2, 3),
                            "FlashREINFORCE's entropy filter: failures keep their 50% highest-entropy tokens (q = "
                            "0.5) against all of them", claim="lower"),
    "flash_lr": Preset(("flash_reinforce", "flash_lr4e4"), (0, 1, 2, 3),
                       "the RL learning rate of the objectives with negatives (FlashREINFORCE): the base's 2e-4 "
                       "against 4e-4; how often a seed's policy collapses, and what each rate learns "
                       "(flash_lr1e4.py: 1e-4)", claim="lower"),
    "flash_lr4e4_parts": Preset(("flash_reinforce", "flash_tr_off", "flash_token_mean", "flash_entropy_q05",
                                 "flash_lag4", "flash_lag4_tr_off"), (0, 1),
                                "the flash and flash_staleness arms at an RL learning rate of 4e-4, where the policy "
                                "can collapse: which parts keep it from collapsing",
                                overrides=(("optimizer.lr", 4e-4),), claim="lower"),
    "flash_staleness": Preset(("flash_lag4", "flash_lag4_tr_off"), (0, 1, 2, 3),
                              "FlashREINFORCE's claim: its sequence trust region keeps updates at policy lag 4 "
                              "stable", claim="lower"),
    "flash_staleness8": Preset(("flash_lag8", "flash_lag8_tr_off"), (0, 1, 2, 3),
                               "the same at policy lag 8", claim="lower"),
    "flash_groups": Preset(("flash_reinforce", "flash_grpo"), (0, 1, 2, 3),
                           "FlashREINFORCE's claim: one rollout per prompt with batch-centred rewards does as well as "
                           "GRPO-style groups of 4 samples per task with group-mean baselines", claim="lower"),
    "longhorizon": Preset(LONGHORIZON_ARMS, (0, 1, 2, 3),
                          "the claims table on the long-horizon kv_chain task (seven chunks per success, failures "
                          "of one to nine turns): IPA against imitation continued, token credit and token credit "
                          "with the first chunk's weight matched", claim="lower"),
    "longhorizon_flash": Preset(LONGHORIZON_FLASH_ARMS, (0, 1, 2, 3),
                                "FlashREINFORCE's aggregation claim where it can show: sample-mean against "
                                "token-mean on kv_chain, whose failures vary several-fold in length", claim="lower"),
    "longhorizon_mixed": Preset(LONGHORIZON_ARMS, (0, 1, 2, 3),
                                "the longhorizon preset on chains of 1-6 hops with a 600-step imitation cap, the warm "
                                "start that works on seeds 0-3", overrides=MIXED_HOPS, claim="lower"),
    "longhorizon_flash_mixed": Preset(LONGHORIZON_FLASH_ARMS, (0, 1, 2, 3),
                                      "the longhorizon_flash preset on chains of 1-6 hops with a 600-step imitation "
                                      "cap, the warm start that works on seeds 0-3", overrides=MIXED_HOPS,
                                      claim="lower"),
    "terminal": Preset(("terminal_credit_chunk", "terminal_control_il_continue", "terminal_credit_token"),
                       (0, 1, 2, 3),
                       "IPA against imitation continued and token credit on the terminal suite's easy tier (shell "
                       "commands in sandboxes); for a policy that learns the tier: the tiny CPU policy stays at ~6% "
                       "(configs/ablations/terminal_common.py)", claim="lower"),
    "staleness_offpolicy": Preset(
        ("offpolicy_lag0", "offpolicy_lag0_nomismatch", "offpolicy_lag0_recompute",
         "offpolicy_lag0_recompute_nomismatch", "offpolicy_lag4", "offpolicy_lag4_nomismatch",
         "offpolicy_lag4_recompute", "offpolicy_lag4_recompute_nomismatch"), (0, 1, 2),
        "policy lag 0 / 4 x mismatch correction on / off x old log-probs behaviour / recompute, with "
        "negatives (batch-mean baseline), shared warm starts"),
}


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


def run_overrides(run_dir: str, seed: int, overrides: Mapping[str, Any] = (), steps: int | None = None
                  ) -> dict[str, Any]:
    """The dotted config overrides of one (config, seed) run of a sweep (`steps`: a warm start's train.steps)."""
    out = {**dict(overrides), "train.seed": seed, "train.run_dir": run_dir}
    if steps is not None:
        out["train.steps"] = steps
    return out


def warm_start_key(config_path: str, overrides: Mapping[str, Any] = ()) -> tuple[str, int] | None:
    """(the config without its RL_PHASE_KEYS as JSON, train.il_warmup_steps), equal for configs whose warm
    starts are the same; None without a warm start or when the config does not load (its run reports why)."""
    try:
        flat = flatten(validate(load_config(config_path, dict(overrides))).to_dict())
    except Exception:  # noqa: BLE001 - the run itself fails with the config's own error message
        return None
    warm = int(flat["train.il_warmup_steps"])
    if warm == 0:
        return None
    return json.dumps(il_phase_view(flat), sort_keys=True, default=repr), warm


def il_phase_view(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a flattened resolved config that its IL warm start reads: all but RL_PHASE_KEYS, and
    optimizer.lr too when optimizer.il_lr is 0 (the warm start then trains at lr)."""
    kept = {k: v for k, v in flat.items() if not k.startswith(RL_PHASE_KEYS)}
    if not flat["optimizer.il_lr"]:
        kept["optimizer.lr"] = flat["optimizer.lr"]
    return kept


def seed_from_warm_start(warm_dir: str, run_dir: str) -> None:
    """Copies a finished warm start into a fresh run folder, which then resumes from its last checkpoint."""
    for name in WARM_START_FILES:
        src, dst = os.path.join(warm_dir, name), os.path.join(run_dir, name)
        if os.path.isdir(src):
            shutil.copytree(src, dst)
        elif os.path.exists(src):
            shutil.copy2(src, dst)


def train_one(config_path: str, overrides: Mapping[str, Any], log_path: str,
              train_command: Sequence[str] | None = None, xla_cache_dir: str | None = None) -> None:
    """One run: `train_command --config=PATH --config.KEY=VALUE ...` as a subprocess (its output to `log_path`;
    with JAX_COMPILATION_CACHE_DIR=`xla_cache_dir` unless the environment sets it), or in this process without a
    command. Raises RuntimeError when the subprocess fails."""
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
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"exit status {rc}")


def sweep(configs: Sequence[tuple[str, str]], seeds: Sequence[int], out: str, *,
          overrides: Mapping[str, Any] = (), threshold: float = 0.5, train_command: Sequence[str] | None = None,
          rerun: bool = False, share_warm_start: bool = True, reference: str | None = None,
          claim: str = "higher") -> dict[str, Any]:
    """Trains every (config, seed) in order with `overrides` on every arm (a line per run as it starts), then writes
    the tables (and prints the Markdown one) and the plots into `out`: differences against `reference` (default the
    first config), verdicts on `claim` ("higher": each config beats the reference; "lower": the reference beats
    it). Returns the manifest (also <out>/ablation.json, rewritten after every run so a partial sweep is
    readable)."""
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
    overrides = dict(overrides)
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    manifest: dict[str, Any] = {
        "configs": dict(configs), "seeds": list(seeds), "overrides": overrides, "threshold": threshold,
        "reference": reference, "claim": claim,
        "isolation": "subprocess" if train_command else "inprocess", "runs": {}, "failed": [], "wall_time_s": {},
        "warm_starts": {},
    }
    # Configs with the same warm start (module doc): the first of each group trains it for all.
    # shared: config name -> (donor config name, its path, IL steps).
    paths = dict(configs)
    donors: dict[tuple[str, int], str] = {}
    shared: dict[str, tuple[str, str, int]] = {}
    if share_warm_start:
        keys = {name: warm_start_key(path, overrides) for name, path in configs}
        for name, _ in configs:
            if keys[name] is not None and sum(k == keys[name] for k in keys.values()) > 1:
                donor = donors.setdefault(keys[name], name)
                shared[name] = (donor, paths[donor], keys[name][1])
    # Seed-major order: after the first len(configs) runs every config has one seed, so a partial sweep compares.
    for seed in seeds:
        for name, path in configs:
            run_dir = os.path.join(out, "runs", name, f"seed_{seed}")
            rel = os.path.relpath(run_dir, out)
            if rerun and os.path.isdir(run_dir):
                shutil.rmtree(run_dir)
            try:
                if RunFolder(run_dir).has_summary():
                    check_finished(path, run_overrides(run_dir, seed, overrides), run_dir)
                else:
                    t0 = time.perf_counter()
                    try:
                        _train_run(name, path, seed, run_dir, out, overrides, shared.get(name), manifest, rerun,
                                   train_command)
                    finally:
                        manifest["wall_time_s"][rel] = time.perf_counter() - t0
                manifest["runs"].setdefault(name, []).append(rel)
            except Exception as e:  # one failed run must not lose the rest of the sweep: record it, go on
                log.error("%s seed %d failed: %s (log: %s/ablate.log)", name, seed, e, run_dir)
                manifest["failed"].append({"config": name, "seed": seed, "run_dir": rel, "error": repr(e),
                                           "traceback": traceback.format_exc()})
            _write_manifest(out, manifest)
    manifest["runs"] = {name: manifest["runs"][name] for name, _ in configs if name in manifest["runs"]}
    _write_manifest(out, manifest)
    if not manifest["runs"]:
        raise RuntimeError(f"every run failed; see {out}/ablation.json and the ablate.log files")
    loaded = load_ablation(out)
    runs = loaded["runs"]
    if ablation_reference(loaded) != reference:
        log.warning("%s has no finished run: differences are taken against %s", reference, ablation_reference(loaded))
    write_tables(out, runs, threshold, reference=ablation_reference(loaded), claim=claim)
    with open(os.path.join(out, "table.md"), encoding="utf-8") as f:
        print(f.read(), flush=True)  # before the plots: a plotting failure loses nothing
    try:
        write_plots(out, runs)
    except ImportError as e:  # the table is written; plots need matplotlib
        log.warning("plots skipped (%s): pip install matplotlib, then rerun the same command", e)
    return manifest


def check_finished(config_path: str, overrides: Mapping[str, Any], run_dir: str, il_phase_only: bool = False
                   ) -> None:
    """Raises ConfigError when the finished run in `run_dir` was trained with another config than `config_path`
    with `overrides` (a config file edited since, or another file of the same name): reusing it would put a
    different experiment in the table under this name. `il_phase_only`: a warm start, compared on the keys its
    IL phase read (il_phase_view)."""
    exp = validate(load_config(config_path, dict(overrides)))
    changes = changes_since(exp, RunFolder(run_dir))
    if il_phase_only:
        read = il_phase_view(flatten(exp.to_dict()))
        changes = {k: v for k, v in changes.items() if k in read}
    if changes:
        raise ConfigError(next(iter(changes)), f"{run_dir} finished with a different config than {config_path} "
                          f"({describe_changes(changes)}); retrain it with --rerun or remove the folder")


def _train_run(name: str, path: str, seed: int, run_dir: str, out: str, overrides: Mapping[str, Any],
               warm_start: tuple[str, str, int] | None, manifest: dict[str, Any], rerun: bool,
               train_command: Sequence[str] | None) -> None:
    """Trains one (config, seed) of a sweep into `run_dir`; with `warm_start` = (donor config name, its path, IL
    steps), from that shared warm start (trained here first when missing, recorded in manifest["warm_starts"])."""
    os.makedirs(run_dir, exist_ok=True)
    xla_cache = os.path.join(out, "xla_cache")
    print(f"[{time.strftime('%H:%M:%S')}] training {name} seed {seed} -> {run_dir}", flush=True)
    if warm_start is not None and not os.path.exists(RunFolder(run_dir).checkpoints_dir):
        donor, donor_path, warm = warm_start
        warm_dir = os.path.join(out, "warm_starts", donor, f"seed_{seed}")
        warm_overrides = run_overrides(warm_dir, seed, overrides, steps=warm)
        if rerun and os.path.isdir(warm_dir) and name == donor:
            shutil.rmtree(warm_dir)
        if RunFolder(warm_dir).has_summary():
            check_finished(donor_path, warm_overrides, warm_dir, il_phase_only=True)
        else:
            os.makedirs(warm_dir, exist_ok=True)
            print(f"[{time.strftime('%H:%M:%S')}] IL warm start of {donor} seed {seed} -> {warm_dir}", flush=True)
            train_one(donor_path, warm_overrides, os.path.join(warm_dir, "ablate.log"), train_command, xla_cache)
        seed_from_warm_start(warm_dir, run_dir)
        manifest["warm_starts"][os.path.relpath(run_dir, out)] = os.path.relpath(warm_dir, out)
    train_one(path, run_overrides(run_dir, seed, overrides), os.path.join(run_dir, "ablate.log"), train_command,
              xla_cache)


def _write_manifest(out: str, manifest: dict[str, Any]) -> None:
    tmp = os.path.join(out, "ablation.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(out, "ablation.json"))
