"""experiments/ablate.py, ipa_jax.analysis.sweep, the sweep presets (configs/sweeps/) and the table / curve numbers
of ipa_jax.analysis.

The end-to-end test trains two tiny configs (chunk vs token credit, built on configs/ablations/common.py) for a few
steps each with the real online pipeline and checks the folder: ablation.json, table.md / table.csv / runs.csv whose
numbers are recomputed here from the run folders, and the PNG plots. Every config file in configs/ablations/ must
load and validate, and change what its name says relative to the common base.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from cpu_env import xla_flags

from ipa_jax import analysis
from ipa_jax.analysis import sweep as ablate
from ipa_jax.analysis.presets import Preset, load_preset, preset_files, resolve_preset
from ipa_jax.pipeline import ConfigError, RunFolder, load_config, validate
from ipa_jax.pipeline.build import warm_start_objective
from ipa_jax.pipeline.config import flatten

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(ROOT, "configs", "ablations")
SWEEP_DIR = os.path.join(ROOT, "configs", "sweeps")
PRESETS = {name: load_preset(path) for name, path in preset_files(SWEEP_DIR).items()}
TRAIN = [sys.executable, os.path.join(ROOT, "experiments", "train.py")]

# A tiny version of the ablation base: 1 layer, hidden 32, a 2-step IL warm start (shared by the two configs, which
# differ only in the RL phase), 4-episode evaluations every 2 RL steps.
TINY_CONFIG = """
from ipa_jax.pipeline import load_config


def get_config():
    c = load_config({common!r})
    c.model.arch.update(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=8,
                             moe_intermediate_size=32))
    c.rollout.max_new_tokens = 24
    c.rollout.concurrency = 8
    c.train.batch_size = 4
    c.train.steps = 6
    c.train.il_warmup_steps = 2
    c.train.il_warmup_target = 0.0
    c.train.eval_every = 2
    c.train.eval_episodes = 4
    c.queue.max_size = 8
    c.logging.tensorboard = False  # tensorboardX imports torch (~3 s) where it is installed
    c.train.name = "{name}"
    c.objective.credit = "{credit}"
    return c
"""


def tiny_config(name: str, credit: str) -> str:
    return TINY_CONFIG.format(common=os.path.join(CONFIG_DIR, "common.py"), name=name, credit=credit)


def test_list_prints_presets_and_configs():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "ablate.py"), "--list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for name, preset in PRESETS.items():
        assert name in proc.stdout and preset.description in proc.stdout
    assert "credit_token" in proc.stdout and "token credit" in proc.stdout  # its docstring's first line


def test_presets_load_by_name_or_path_described_by_their_docstring(tmp_path):
    assert {"small", "claims", "longhorizon_mixed"} <= set(PRESETS)
    name, small = resolve_preset("small", SWEEP_DIR)
    assert name == "small" and small == resolve_preset(os.path.join(SWEEP_DIR, "small.py"), SWEEP_DIR)[1]
    assert small.description.startswith("Chunk vs token credit, 2 seeds") and "\n" not in small.description
    with pytest.raises(ValueError, match="must be one of .*small.* or the path of a preset file, got 'smal'"):
        resolve_preset("smal", SWEEP_DIR)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def get_preset():\n    return ('credit_chunk',)\n")
    with pytest.raises(ValueError, match="get_preset\\(\\) must return a Preset"):
        load_preset(wrong)


# ------------------------------------------------------------------------------------ analysis numbers
def test_curve_auc_and_threshold_match_formulas():
    steps = np.array([0, 10, 30, 40])
    values = np.array([0.0, 0.5, 0.25, 1.0])
    # Trapezoids by hand: (0+0.5)/2*10 + (0.5+0.25)/2*20 + (0.25+1)/2*10 = 2.5 + 7.5 + 6.25, over 40 steps.
    assert analysis.curve_auc(steps, values) == pytest.approx(16.25 / 40)
    assert analysis.curve_auc(steps[:1], values[:1]) == 0.0
    assert math.isnan(analysis.curve_auc(steps[:0], values[:0]))
    assert analysis.steps_to_threshold(steps, values, 0.5) == 10
    assert analysis.steps_to_threshold(steps, values, 0.9) == 40
    assert math.isnan(analysis.steps_to_threshold(steps, values, 1.1))


def test_smooth_and_seed_band_match_loops():
    rng = np.random.default_rng(0)
    x = rng.normal(size=17)
    naive = [x[max(0, i - 4) : i + 1].mean() for i in range(len(x))]
    np.testing.assert_allclose(analysis.smooth(x, 5), naive, rtol=1e-12)
    a = (np.array([0, 2, 4, 6]), np.array([0.0, 1.0, 2.0, 3.0]))
    b = (np.array([0, 2, 4]), np.array([1.0, 1.0, 4.0]))  # a shorter seed: the band covers common steps
    steps, mean, std = analysis.seed_band([a, b])
    np.testing.assert_array_equal(steps, [0, 2, 4])
    np.testing.assert_allclose(mean, [0.5, 1.0, 3.0])
    np.testing.assert_allclose(std, [math.sqrt(0.5), 0.0, math.sqrt(2.0)])  # sample std of two values


# Every ablation file: (the config it starts from, the resolved keys it changes there, besides train.name).
# An empty set = the base's own value restated, the reference arm of its comparison.
_OBJ = "objective."
# What FlashREINFORCE's objective preset changes from IPA's (as the ablation bases set it).
FLASH_FIELDS = {
    "baseline",
    "credit",
    "gamma",
    "is_apply_to",
    "is_clip_max",
    "is_level",
    "mismatch_level",
    "trust_region_level",
}
ABLATIONS = {
    "credit_chunk": ("common", set()),
    "credit_token": ("common", {_OBJ + "credit"}),
    "credit_trajectory": ("common", {_OBJ + "credit"}),
    "credit_branch": ("common", {_OBJ + "credit", "rollout.schedule"}),  # branching needs the async worker
    "gamma_0_8": ("common", {_OBJ + "gamma"}),
    "gamma_1_0": ("common", {_OBJ + "gamma"}),
    "is_none": ("common_negatives", {_OBJ + "is_level"}),
    "is_token": ("common_negatives", {_OBJ + "is_level"}),
    "is_chunk": ("common_negatives", set()),
    "is_sequence": ("common_negatives", {_OBJ + "is_level"}),
    "trunc_neg_on": ("common_negatives", set()),
    "trunc_neg_off": ("common_negatives", {_OBJ + "is_clip_max"}),
    "tr_none": ("common", set()),
    "tr_seq": ("common", {_OBJ + "trust_region_level"}),
    "tr_seq_delta1e3": ("common", {_OBJ + "trust_region_level", _OBJ + "trust_region_delta"}),
    "tr_seq_delta1e2": ("common", {_OBJ + "trust_region_level", _OBJ + "trust_region_delta"}),
    "agg_sample_mean": ("common", set()),
    "agg_token_mean": ("common", {_OBJ + "aggregation"}),
    "agg_chunk_mean": ("common", {_OBJ + "aggregation"}),
    "baseline_batch_mean": ("common", {_OBJ + "baseline"}),
    "baseline_none": ("common", set()),
    "il_warmup_off": ("common", {"train.il_warmup_steps"}),
    "il_term_off": ("common", {"rollout.source"}),
    "il_term_on": ("il_term_off", {"resample.il_fallback", "resample.il_whole_episode", _OBJ + "il_weight"}),
    "grpo": ("common_negatives", {"rollout.group_size", _OBJ + "baseline"}),
    "grpo_dynamic_sampling": ("grpo", {"queue.dynamic_sampling", "rollout.schedule"}),  # the async queue's groups
    # FlashREINFORCE's objective on the negatives' base, then its own ablations.
    "flash_reinforce": ("common_negatives", {_OBJ + k for k in FLASH_FIELDS - {"baseline"}}),
    "flash_grpo": ("flash_reinforce", {"rollout.group_size", _OBJ + "baseline"}),
    "flash_tr_off": ("flash_reinforce", {_OBJ + "trust_region_level"}),
    "flash_token_mean": ("flash_reinforce", {_OBJ + "aggregation"}),
    "flash_entropy_q05": ("flash_reinforce", {_OBJ + "negative_token_fraction"}),
    "flash_lr1e4": ("flash_reinforce", {"optimizer.lr"}),
    "flash_lr4e4": ("flash_reinforce", {"optimizer.lr"}),
    "flash_lag4": ("flash_reinforce", {"queue.max_policy_lag"}),
    "flash_lag8": ("flash_reinforce", {"queue.max_policy_lag"}),
    "flash_lag4_tr_off": ("flash_lag4", {_OBJ + "trust_region_level"}),
    "flash_lag8_tr_off": ("flash_lag8", {_OBJ + "trust_region_level"}),
    "lag4": ("common", {"queue.max_policy_lag"}),
    "lag8": ("common", {"queue.max_policy_lag"}),
    "lag4_tr": ("lag4", {_OBJ + "trust_region_level"}),
    "lag8_tr": ("lag8", {_OBJ + "trust_region_level"}),
    # The staleness_offpolicy preset: lag x mismatch correction x old log-probs, on the negative branch's base.
    "offpolicy_lag0": ("common_negatives", {"queue.max_policy_lag"}),  # lag 0 (the common base: lockstep lag 1)
    "offpolicy_lag0_nomismatch": ("offpolicy_lag0", {_OBJ + "mismatch_level"}),
    "offpolicy_lag0_recompute": ("offpolicy_lag0", {_OBJ + "old_logprobs"}),
    "offpolicy_lag0_recompute_nomismatch": ("offpolicy_lag0_recompute", {_OBJ + "mismatch_level"}),
    "offpolicy_lag4": ("offpolicy_lag0", {"queue.max_policy_lag"}),
    "offpolicy_lag4_nomismatch": ("offpolicy_lag4", {_OBJ + "mismatch_level"}),
    "offpolicy_lag4_recompute": ("offpolicy_lag4", {_OBJ + "old_logprobs"}),
    "offpolicy_lag4_recompute_nomismatch": ("offpolicy_lag4_recompute", {_OBJ + "mismatch_level"}),
    # The baselines papers report (objective presets, docs/objectives.md) and DAPO's overlong shaping.
    "estimator_grpo": (
        "grpo",
        {_OBJ + k for k in ("advantage_norm", "credit", "gamma", "old_logprobs", "is_level", "mismatch_level")}
        | {_OBJ + "surrogate"},
    ),
    "estimator_dr_grpo": ("estimator_grpo", {_OBJ + "advantage_norm", _OBJ + "aggregation", _OBJ + "norm_length"}),
    "estimator_rloo": (
        "grpo",
        {_OBJ + k for k in ("baseline", "credit", "gamma", "is_level", "mismatch_level", "aggregation")},
    ),
    "estimator_reinforce_pp": (
        "common_negatives",
        {_OBJ + k for k in ("baseline", "advantage_norm", "credit", "gamma", "old_logprobs", "is_level")}
        | {_OBJ + k for k in ("mismatch_level", "aggregation", "surrogate")},
    ),
    "surrogate_ppo_dual_clip": (
        "common_negatives",
        {_OBJ + k for k in ("credit", "gamma", "old_logprobs", "is_level", "mismatch_level", "aggregation")}
        | {_OBJ + "surrogate", _OBJ + "ppo_dual_clip"},
    ),
    "overlong_shaping": ("common", {_OBJ + "overlong_max_length", _OBJ + "overlong_buffer_length"}),
    "overlong_filter": ("common", {_OBJ + "overlong_filter"}),
    # Controls (tests/pipeline/test_pipeline_controls.py checks what each one does).
    "control_il_continue": ("common", {_OBJ + "rl_weight", _OBJ + "il_weight", "optimizer.lr"}),
    "control_no_update": ("common", {"optimizer.lr"}),
    "control_aa": ("credit_chunk", {"rollout.seed_offset"}),
    "credit_token_other_keys": ("credit_token", {"rollout.seed_offset"}),
    "control_advantage_flip": ("credit_chunk", {_OBJ + "advantage_sign"}),
    "control_reward_flip": ("credit_chunk", {"train.reward_flip_fraction"}),
    "credit_token_matched": ("common", {_OBJ + "credit", _OBJ + "gamma"}),
    # IL continuation at IPA's lr and aggregation (its data is the one difference), and filtered imitation.
    "control_il_continue_matched": ("common", {_OBJ + "rl_weight", _OBJ + "il_weight", _OBJ + "il_aggregation"}),
    "control_il_filtered": ("control_il_continue_matched", {"rollout.expert_successes_only"}),
    # Chunk vs token credit with a baseline subtracted after discounting (failures carry negative credit, and a
    # success's units can differ in sign), each from its no-baseline arm.
    "credit_chunk_baseline": ("credit_chunk", {_OBJ + "baseline", _OBJ + "baseline_stage", "optimizer.lr"}),
    "credit_token_baseline": ("credit_token", {_OBJ + "baseline", _OBJ + "baseline_stage", "optimizer.lr"}),
    "credit_token_matched_baseline": (
        "credit_token_matched",
        {_OBJ + "baseline", _OBJ + "baseline_stage", "optimizer.lr"},
    ),
    # The long-horizon task's base (longhorizon_common) and its arms.
    "longhorizon_credit_chunk": ("longhorizon_common", set()),
    "longhorizon_credit_token": ("longhorizon_common", {_OBJ + "credit"}),
    "longhorizon_agg_token_mean": ("longhorizon_common", {_OBJ + "aggregation"}),
    "longhorizon_control_il_continue": ("longhorizon_common", {_OBJ + "rl_weight", _OBJ + "il_weight", "optimizer.lr"}),
    "longhorizon_control_no_update": ("longhorizon_common", {"optimizer.lr"}),
    "longhorizon_credit_token_matched": ("longhorizon_common", {_OBJ + "credit", _OBJ + "gamma"}),
    "longhorizon_flash_reinforce": ("longhorizon_common", {"optimizer.lr"} | {_OBJ + k for k in FLASH_FIELDS}),
    "longhorizon_flash_token_mean": ("longhorizon_flash_reinforce", {_OBJ + "aggregation"}),
    # The reference KL, as a loss term or a reward penalty, against the policy at RL's start.
    "kl_loss": ("common", {"model.reference", _OBJ + "kl_weight"}),
    "kl_penalty": ("common", {"model.reference", _OBJ + "kl_penalty"}),
    # The terminal suite's base (terminal_common) and its arms.
    "terminal_credit_chunk": ("terminal_common", set()),
    "terminal_credit_token": ("terminal_common", {_OBJ + "credit"}),
    "terminal_control_il_continue": ("terminal_common", {_OBJ + "rl_weight", _OBJ + "il_weight", "optimizer.lr"}),
}


def _flat_resolved(name: str) -> dict:
    """The resolved config (objective preset expanded) of configs/ablations/<name>.py as {dotted key: value}."""
    return flatten(validate(load_config(os.path.join(CONFIG_DIR, f"{name}.py"))).to_dict())


def test_every_ablation_config_changes_one_thing():
    files = {
        os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "configs", "ablations", "*.py"))
    }
    assert files - {"common", "common_negatives", "longhorizon_common", "terminal_common"} == set(ABLATIONS)
    # The negative branch's base: the common base with negative advantages, at the lr stable with them.
    negatives, common = _flat_resolved("common_negatives"), _flat_resolved("common")
    assert {k for k in negatives if negatives[k] != common[k]} - {"train.name"} == {_OBJ + "baseline", "optimizer.lr"}
    for name, (parent, changed) in ABLATIONS.items():
        config, base = _flat_resolved(name), _flat_resolved(parent)
        assert config["train.name"] == name
        assert {k for k in config if config[k] != base[k]} - {"train.name"} == changed, name
    for preset in PRESETS.values():
        assert set(preset.configs) <= files
        for name in preset.configs if preset.overrides else ():  # they name real keys (validate rejects others)
            validate(load_config(os.path.join(CONFIG_DIR, f"{name}.py"), dict(preset.overrides)))
    # negatives_lag4's overrides make its reference arm the off-policy sweep's lag-4 config (is_chunk restates the
    # negatives' base, as offpolicy_lag0 does).
    forced = flatten(
        validate(
            load_config(os.path.join(CONFIG_DIR, "is_chunk.py"), dict(PRESETS["negatives_lag4"].overrides))
        ).to_dict()
    )
    lag4 = _flat_resolved("offpolicy_lag4")
    assert {k for k in lag4 if lag4[k] != forced[k]} == {"train.name"}
    # The mixed-hop long-horizon presets reach the env's nested kwargs and change only the warm start's task and cap.
    mixed = flatten(
        validate(
            load_config(
                os.path.join(CONFIG_DIR, "longhorizon_flash_reinforce.py"),
                dict(PRESETS["longhorizon_flash_mixed"].overrides),
            )
        ).to_dict()
    )
    fixed = _flat_resolved("longhorizon_flash_reinforce")
    assert {k: mixed[k] for k in mixed if mixed[k] != fixed[k]} == {
        "env.kwargs": {**fixed["env.kwargs"], "min_hops": 1},
        "train.il_warmup_steps": 600,
        "train.steps": 680,
    }
    assert PRESETS["longhorizon_mixed"].configs == PRESETS["longhorizon"].configs
    # The claims preset: 8 seeds x 512 held-out tasks on the calculator with 2 and 3 operations, the expert perfect
    # and wrong on half the tasks; warm starts to the imitation plateau, one per seed for every arm
    # (test_every_arm_of_the_claims_preset_shares_one_warm_start).
    claims = PRESETS["claims"]
    assert (claims.reference, claims.claim, len(claims.seeds)) == ("credit_chunk", "lower", 8)
    assert dict(claims.overrides)["train.eval_episodes"] == 512 and dict(claims.overrides)["train.il_warmup_patience"]
    assert [dict(o) for _, o in claims.conditions] == [
        {"env.kwargs.ops": ops, "env.expert_error": error} for ops in (2, 3) for error in (0.0, 0.5)
    ]
    assert {"control_il_continue_matched", "control_il_filtered", "credit_token_matched", "il_term_on"} <= set(
        claims.configs
    )
    assert dict(claims.pairs) == {
        "credit_token_baseline": "credit_chunk_baseline",
        "credit_token_matched_baseline": "credit_chunk_baseline",
        "il_term_off": "il_term_on",
    }
    assert (claims.claims, claims.aa_controls) == (
        ("control_il_continue_matched", "credit_token_baseline", "il_term_off"),
        ("control_aa",),
    )
    with pytest.raises(ValueError, match="reference 'lag4' is not one of the configs"):
        Preset(("credit_chunk",), (0,), reference="lag4")
    with pytest.raises(ValueError, match="claim must be one of"):
        Preset(("credit_chunk",), (0,), claim="better")
    # The controls preset: its positive control is declared, and every control shares credit_chunk's warm start.
    controls = PRESETS["controls"]
    assert (controls.reference, controls.controls) == (
        "credit_chunk",
        ("control_advantage_flip", "control_reward_flip"),
    )
    reference_key = ablate.warm_start_key(os.path.join(CONFIG_DIR, "credit_chunk.py"), {})
    assert reference_key is not None and all(
        ablate.warm_start_key(os.path.join(CONFIG_DIR, f"{name}.py"), {}) == reference_key for name in controls.configs
    )
    with pytest.raises(ValueError, match="controls .* other than the reference"):
        Preset(("credit_chunk", "control_aa"), (0,), controls=("credit_chunk",))
    with pytest.raises(ValueError, match="controls .* other than the reference"):
        Preset(("credit_chunk",), (0,), controls=("control_aa",))
    # The values the names promise (a few; the rest follow the same pattern).
    assert _flat_resolved("credit_token")[_OBJ + "credit"] == "token"
    assert _flat_resolved("trunc_neg_off")[_OBJ + "is_clip_max"] == math.inf
    assert _flat_resolved("lag8_tr")["queue.max_policy_lag"] == 8  # lockstep: every batch 8 updates old
    stale = _flat_resolved("offpolicy_lag4_recompute_nomismatch")
    assert (stale["queue.max_policy_lag"], stale[_OBJ + "old_logprobs"], stale[_OBJ + "mismatch_level"]) == (
        4,
        "recompute",
        "none",
    )
    assert _flat_resolved("il_term_on")["resample.il_whole_episode"] is True
    assert _flat_resolved("grpo")[_OBJ + "baseline"] == "group_mean"
    flash = _flat_resolved("flash_reinforce")
    assert (flash[_OBJ + "credit"], flash[_OBJ + "is_level"], flash[_OBJ + "trust_region_level"]) == (
        "trajectory",
        "token",
        "sequence",
    )
    assert (
        flash["optimizer.lr"]
        == _flat_resolved("common_negatives")["optimizer.lr"]
        < _flat_resolved("common")["optimizer.lr"]
    )
    assert _flat_resolved("flash_lag8_tr_off")["queue.max_policy_lag"] == 8
    assert _flat_resolved("flash_entropy_q05")[_OBJ + "negative_token_fraction"] == 0.5
    assert _flat_resolved("common")[_OBJ + "baseline"] == "none"  # IPA as published
    assert _flat_resolved("is_none")[_OBJ + "baseline"] == "batch_mean"  # so the negative-branch switches act


def test_subprocess_runs_share_an_xla_cache_in_the_sweep_folder(tmp_path, monkeypatch):
    """Each run's process gets JAX_COMPILATION_CACHE_DIR=<out>/xla_cache, or the environment's own when it sets one
    (a stand-in training command prints it, then fails: the sweep records the failure)."""
    config = tmp_path / "tiny_chunk.py"
    config.write_text(tiny_config("tiny_chunk", "chunk"))
    show = [
        sys.executable,
        "-c",
        "import os; print('xla cache:', os.environ.get('JAX_COMPILATION_CACHE_DIR')); raise SystemExit(3)",
    ]

    def cache_of_a_run(out):
        with pytest.raises(RuntimeError, match="every run failed"):
            ablate.sweep([ablate.resolve_config(str(config), CONFIG_DIR)], seeds=[0], out=str(out), train_command=show)
        log = open(os.path.join(out, "runs", "tiny_chunk", "seed_0", "ablate.log"), encoding="utf-8").read()
        assert "exit status 3" in json.load(open(os.path.join(out, "ablation.json")))["failed"][0]["error"]
        return log.split("xla cache: ")[1].split()[0]

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert cache_of_a_run(tmp_path / "a") == str(tmp_path / "a" / "xla_cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_of_a_run(tmp_path / "b") == str(tmp_path / "mine")


# ------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """Two tiny configs x one seed, trained by `python experiments/ablate.py --isolation=inprocess`, evaluated on 3
    held-out tasks x 2 samples (--eval_tasks, --eval_samples), differences against the second config."""
    tmp = tmp_path_factory.mktemp("ablate")
    paths = []
    for credit in ("chunk", "token"):
        path = tmp / f"tiny_{credit}.py"
        path.write_text(tiny_config(f"tiny_{credit}", credit))
        paths.append(str(path))
    out = tmp / "out"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "experiments", "ablate.py"),
        f"--configs={','.join(paths)}",
        "--seeds=0",
        "--set=train.steps=4",
        f"--out={out}",
        "--threshold=0.0",
        "--isolation=inprocess",
        "--eval_tasks=3",
        "--eval_samples=2",
        "--reference=tiny_token",
        "--claim=lower",
    ]
    # One CPU device (not conftest's 8): a batch of 4 needs no data-parallel split, and 2 cores run it faster.
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return str(out), proc.stdout


@pytest.mark.slow
def test_ablate_writes_table_and_plots(tiny_sweep):
    out, stdout = tiny_sweep
    manifest = analysis.load_ablation(out)
    assert manifest["failed"] == [] and list(manifest["runs"]) == ["tiny_chunk", "tiny_token"]
    for name, (run_dir,) in manifest["runs"].items():
        summary = RunFolder(run_dir).read_summary()
        assert summary["steps"] == 4  # --set=train.steps=4 overrides the config's 6
        assert summary["seed"] == 0
        assert RunFolder(run_dir).read_config()["objective"]["credit"] == name.split("_")[1]
    with open(os.path.join(out, "table.csv"), encoding="utf-8") as f:
        table = {row["config"]: row for row in csv.DictReader(f)}
    assert set(table) == {"tiny_chunk", "tiny_token"}
    for name, (run_dir,) in manifest["runs"].items():
        # Recompute from the files: final success from summary.json, AUC and admitted fraction from metrics.jsonl.
        summary = RunFolder(run_dir).read_summary()
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        evals = sorted((r["step"], r["eval/success"]) for r in rows if "eval/success" in r)
        s, v = np.array(evals, dtype=np.float64).T
        auc = np.sum((v[1:] + v[:-1]) / 2 * np.diff(s)) / (s[-1] - s[0])
        admitted = np.mean([r["admitted_fraction"] for r in rows if "admitted_fraction" in r])
        row = table[name]
        assert row["n_seeds"] == "1" and row["success_after_std"] == ""  # one seed: no std
        assert float(row["success_after_mean"]) == pytest.approx(summary["success_after"])
        assert float(row["auc_mean"]) == pytest.approx(auc)
        assert float(row["admitted_fraction_mean"]) == pytest.approx(admitted)
        assert float(row["wall_time_s_mean"]) == pytest.approx(summary["wall_time_s"])
        assert float(row["steps_to_threshold_mean"]) == 0.0  # threshold 0: reached at the first evaluation
    # One warm start for both (they differ only in objective.credit): identical IL steps, then their own RL.
    warm = {manifest["warm_starts"][os.path.relpath(run_dir, out)] for (run_dir,) in manifest["runs"].values()}
    assert warm == {os.path.join("warm_starts", "tiny_chunk", "seed_0")}
    chunk, token = (
        [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"), encoding="utf-8")]
        for (d,) in manifest["runs"].values()
    )
    assert [r["step"] for r in chunk] == [r["step"] for r in token]
    assert [r for r in chunk if r["step"] <= 2] == [r for r in token if r["step"] <= 2]
    for i, (name, (run_dir,)) in enumerate(manifest["runs"].items(), start=1):  # a line per finished run
        summary = RunFolder(run_dir).read_summary()
        before, after = (f"{100 * summary[k]:.1f}%" for k in ("success_before", "success_after"))
        assert f"[{i}/2] {name} seed 0: held-out success {before} -> {after} in " in stdout
    md = open(os.path.join(out, "table.md"), encoding="utf-8").read()
    # two configs, then tiny_chunk - tiny_token, then the two configs per task family (the 3 tasks hold 2 families)
    assert md in stdout and md.count("\n| tiny_") == 5
    assert "verdict on the claim: config < tiny_token" in md
    # Every evaluation stored task by task: 3 tasks x 2 samples at the rollout temperature (eval_temperature is 0),
    # the same tasks in both arms; the warm start's evaluation (step 2) copied into both.
    records = {name: RunFolder(run_dir) for name, (run_dir,) in manifest["runs"].items()}
    for name, folder in records.items():
        assert folder.eval_tasks_steps() == [0, 2, 4], name
        last = folder.read_eval_tasks(4)
        assert (last["samples_per_task"], last["temperature"], len(last["tasks"])) == (2, 1.0, 3)
        assert all(t["samples"] == 2 for t in last["tasks"])
        assert last["success"] == pytest.approx(RunFolder(folder.path).read_summary()["success_after"])
        # The CI and the paired columns come from these records.
        assert table[name]["ci_resampled"] == "seeds, tasks" and table[name]["reference"] == "tiny_token"
    chunk_tasks, token_tasks = (f.read_eval_tasks(4)["tasks"] for f in records.values())
    assert [t["task_id"] for t in chunk_tasks] == [t["task_id"] for t in token_tasks]
    assert records["tiny_chunk"].read_eval_tasks(2) == records["tiny_token"].read_eval_tasks(2)
    rate = {name: sum(t["successes"] for t in f.read_eval_tasks(4)["tasks"]) / 6 for name, f in records.items()}
    assert float(table["tiny_chunk"]["diff_mean"]) == pytest.approx(rate["tiny_chunk"] - rate["tiny_token"])
    assert table["tiny_chunk"]["diff_seeds"] == "1" and table["tiny_chunk"]["diff_tasks"] == "3"
    for filename, *_ in analysis.ABLATION_PLOTS:
        with open(os.path.join(out, filename), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_ablate_reuses_finished_runs_and_records_failures(tiny_sweep, tmp_path, monkeypatch, capsys):
    """Rerunning into the same folder trains nothing new; a config that fails (subprocess isolation) is
    recorded and the finished runs still make the table, also when the plots cannot be drawn."""
    out, _ = tiny_sweep
    bad = tmp_path / "bad.py"
    bad.write_text(tiny_config("bad", "no_such_credit"))
    os.remove(os.path.join(out, "table.csv"))

    def no_matplotlib(*args):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(ablate, "write_plots", no_matplotlib)
    before = {
        d: os.path.getmtime(os.path.join(d, "summary.json")) for d in glob.glob(os.path.join(out, "runs", "*", "*"))
    }
    configs = [
        ablate.resolve_config(p, CONFIG_DIR)
        for p in json.load(open(os.path.join(out, "ablation.json")))["configs"].values()
    ]
    overrides = {"train.steps": 4, "train.eval_episodes": 3, "train.eval_samples": 2}  # the fixture's flags
    manifest = ablate.sweep(
        configs + [ablate.resolve_config(str(bad), CONFIG_DIR)],
        seeds=[0],
        out=out,
        overrides=overrides,
        threshold=0.0,
        train_command=TRAIN,
    )
    assert {d: os.path.getmtime(os.path.join(d, "summary.json")) for d in before} == before
    (failure,) = manifest["failed"]
    assert failure["config"] == "bad" and "exit status" in failure["error"]
    lines = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\[\d+/\d+\] ", line)]
    assert [line.split(":")[0] for line in lines] == [
        "[1/3] tiny_chunk seed 0",
        "[2/3] tiny_token seed 0",
        "[3/3] bad seed 0",
    ]
    assert "(finished earlier)" in lines[0] and "FAILED: exit status" in lines[2]
    log = open(os.path.join(out, failure["run_dir"], "ablate.log"), encoding="utf-8").read()
    assert "no_such_credit" in log  # the run's own error message, not a generic one
    with open(os.path.join(out, "table.csv"), encoding="utf-8") as f:
        assert [r["config"] for r in csv.DictReader(f)] == ["tiny_chunk", "tiny_token"]

    # A config edited since its run finished (same name, another gamma): the old run is not tabled as the new arm.
    edited = tmp_path / "edited" / "tiny_chunk.py"
    edited.parent.mkdir()
    edited.write_text(tiny_config("tiny_chunk", "chunk").replace("return c", "c.objective.gamma = 0.5\n    return c"))
    manifest = ablate.sweep(
        [ablate.resolve_config(str(edited), CONFIG_DIR), configs[1]],
        seeds=[0],
        out=out,
        overrides=overrides,
        threshold=0.0,
        train_command=TRAIN,
    )
    assert {d: os.path.getmtime(os.path.join(d, "summary.json")) for d in before} == before
    (failure,) = manifest["failed"]
    assert failure["config"] == "tiny_chunk" and "objective.gamma: 0.95 -> 0.5" in failure["error"]
    assert "--rerun" in failure["error"] and list(manifest["runs"]) == ["tiny_token"]
    # A shared warm start is checked on what its IL phase read: the edited gamma is an RL-phase key, the IL
    # learning rate is not.
    warm_dir = os.path.join(out, "warm_starts", "tiny_chunk", "seed_0")
    warm_overrides = ablate.run_overrides(warm_dir, 0, overrides, steps=2)
    ablate.check_finished(str(edited), warm_overrides, warm_dir, il_phase_only=True)
    # A finished run is reused whatever a guard says that did not stop it.
    run_dir = os.path.join(out, "runs", "tiny_token", "seed_0")
    guard = {"train.max_consecutive_zero_grad": 0, "train.max_consecutive_skipped": 0}
    ablate.check_finished(configs[1][1], {**ablate.run_overrides(run_dir, 0, overrides), **guard}, run_dir)
    with pytest.raises(ConfigError, match=r"optimizer.il_lr: .* -> 0.5"):
        ablate.check_finished(str(edited), {**warm_overrides, "optimizer.il_lr": 0.5}, warm_dir, il_phase_only=True)


def test_every_arm_of_the_claims_preset_shares_one_warm_start():
    """One warm start per condition and seed: under the claims preset's overrides and each condition's, every arm
    has credit_chunk's warm_start_key (the IL term's arms included: their rollout source and resample.* settings
    act after rl_start only), trained by the first arm, credit_chunk (a resampling arm resumes from a queue arm's warm
    start: tests/pipeline/test_pipeline_online.py); at expert_error 0 control_il_filtered is no run of its own
    (the same effective config as control_il_continue_matched)."""
    claims = PRESETS["claims"]
    for condition, settings in claims.conditions:
        overrides = dict(claims.overrides) | dict(settings)
        arms = [ablate.resolve_config(name, CONFIG_DIR) for name in claims.configs]
        flats = {name: ablate.resolved_flat(path, overrides) for name, path in arms}
        keys = {name: ablate.il_phase_key(flat) for name, flat in flats.items()}  # warm_start_key's, loaded once
        assert keys["credit_chunk"] is not None and set(keys.values()) == {keys["credit_chunk"]}, condition
        error = dict(settings)["env.expert_error"]
        assert keys["credit_chunk"][0].count(f'"env.expert_error": {error}') == 1
        same_as = ablate.same_runs(flats)
        assert same_as == ({} if error else {"control_il_filtered": "control_il_continue_matched"})
        trained = [(name, path) for name, path in arms if name not in same_as]
        shared = ablate.shared_warm_starts(trained, flats)
        assert set(shared) == {name for name, _ in trained}
        assert set(shared.values()) == {("credit_chunk", dict(arms)["credit_chunk"], 600)}
        # ... and each arm alone would train the same warm start: the fields its IL-only loss reads are the same
        # (control_il_continue_matched's sample-mean imitation is its RL phase's; the rest is weighted 0)
        read = ("rl_weight", "il_weight", "il_aggregation", "entropy_weight", "kl_weight", "kl_penalty")
        warm = {
            name: [getattr(warm_start_objective(validate(load_config(path, overrides)).objective), f) for f in read]
            for name, path in arms
        }
        assert warm["credit_chunk"] == [0.0, 1.0, "token_mean", 0.0, 0.0, 0.0]
        assert all(fields == warm["credit_chunk"] for fields in warm.values()), condition


def test_warm_start_key_groups_configs_that_differ_only_in_the_rl_phase(tmp_path):
    def key(name):
        return ablate.warm_start_key(ablate.resolve_config(name, CONFIG_DIR)[1])

    assert key("credit_chunk") == key("credit_token") == key("agg_token_mean") == key("lag4_tr") is not None
    assert key("credit_chunk") == key("baseline_batch_mean")  # objective and RL learning rate: RL phase only
    assert key("il_warmup_off") is None  # no warm start to share
    assert key("grpo") == key("credit_chunk")  # group_size: how RL samples
    changed_il = tmp_path / "il_lr.py"
    changed_il.write_text(
        tiny_config("il_lr", "chunk").replace(
            "return c", "c.train.il_warmup_steps = 2\n    c.optimizer.il_lr = 1e-2\n    return c"
        )
    )
    same_il = tmp_path / "same.py"
    same_il.write_text(tiny_config("same", "token"))
    assert ablate.warm_start_key(str(changed_il)) != ablate.warm_start_key(str(same_il)) is not None
    # With il_lr = 0 the warm start trains at optimizer.lr: then the RL learning rate is not an RL-phase key.
    rl_lr = {"optimizer.lr": 4e-4}
    assert ablate.warm_start_key(str(same_il), rl_lr) == ablate.warm_start_key(str(same_il))
    assert ablate.warm_start_key(str(same_il), {**rl_lr, "optimizer.il_lr": 0.0}) != ablate.warm_start_key(
        str(same_il), {"optimizer.il_lr": 0.0}
    )
    bad = tmp_path / "bad.py"
    bad.write_text(tiny_config("bad", "no_such_credit"))
    assert ablate.warm_start_key(str(bad)) is None  # its own run reports the error


def test_resolve_config_names_and_errors(tmp_path):
    name, path = ablate.resolve_config("credit_token", CONFIG_DIR)
    assert name == "credit_token" and path == os.path.join(CONFIG_DIR, "credit_token.py")
    with pytest.raises(ValueError, match="no config file"):
        ablate.resolve_config("credit_tokne", CONFIG_DIR)
    with pytest.raises(ValueError, match="share a name"):
        ablate.sweep([("a", path), ("a", path)], [0], str(tmp_path))


FAKE_RUN = """
import os, signal, sys, time
out = sys.argv[1].split("=", 1)[1]  # --config=<a folder of this test>
def stop(signum, frame):
    open(os.path.join(out, "stopped"), "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(out, "started"), "w").close()
time.sleep(120)
"""

SWEEP_DRIVER = """
import sys
from ipa_jax.analysis.sweep import train_one
train_one(sys.argv[1], {}, sys.argv[2], train_command=[sys.executable, sys.argv[3]])
"""


def test_a_sweep_stopped_by_sigterm_stops_its_run_in_progress(tmp_path):
    """`timeout` or a scheduler sends SIGTERM to the sweep alone: the training subprocess of the run in progress gets
    it too (and saves its checkpoint), and the sweep exits with status 143; none is left training on its own."""
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_RUN)
    driver = subprocess.Popen(
        [sys.executable, "-c", SWEEP_DRIVER, str(tmp_path), str(tmp_path / "run.log"), str(fake)],
        start_new_session=True,  # the test's SIGTERM reaches the sweep alone, as `timeout`'s does
    )
    for _ in range(600):
        if (tmp_path / "started").exists():
            break
        time.sleep(0.1)
    assert (tmp_path / "started").exists(), "the fake run never started"
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) == 143
    assert (tmp_path / "stopped").exists()
