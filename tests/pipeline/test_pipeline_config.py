"""Config system: locked base config, dotted overrides, validation messages that name the key, presets,
typed dataclasses, and the launcher rejecting a misspelled flag."""

import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest
from ml_collections import ConfigDict

from ipa_jax.envs import CalculatorEnv
from ipa_jax.models import MeshConfig
from ipa_jax.objectives import PRESETS, ObjectiveConfig, flash_reinforce_config
from ipa_jax.pipeline import ExperimentConfig
from ipa_jax.pipeline.config import (
    OBJECTIVE_FIELDS,
    OBJECTIVE_PRESETS,
    SECTIONS,
    ConfigError,
    apply_overrides,
    base_config,
    config_from_dict,
    field_help,
    format_config_help,
    load_config,
    validate,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "offline_tiny.py")
CREDIT = os.path.join(REPO, "configs", "ablations", "credit_token.py")


def test_base_and_tiny_configs_validate():
    validate(base_config())
    validate(load_config(os.path.join(REPO, "configs", "base.py")))
    exp = validate(load_config(TINY))
    assert exp.model.arch["vocab_size"] == 128 and exp.train.steps == 6
    assert exp.objective == OBJECTIVE_PRESETS["ipa"]


@pytest.mark.parametrize(
    "name", sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "configs", "*.py")))
)
def test_every_top_level_config_validates(name):
    """configs/*.py load, validate and convert to dataclasses (configs/ablations/: test_analysis_sweep.py)."""
    exp = validate(load_config(os.path.join(REPO, "configs", f"{name}.py")))
    if name.startswith("resample_"):  # the hard task: the quickstart's policy on three-call calculator tasks
        assert exp.model.path.endswith("quickstart/hf") and exp.env.kwargs["ops"] == 3
        assert exp.rollout.max_turns >= 4
        plain = validate(load_config(os.path.join(REPO, "configs", "resample_plain.py")))
        assert exp.train.steps == plain.train.steps  # the comparison: the same number of updates
        if name == "resample_il_only":  # the reference: every update imitates
            assert exp.train.il_warmup_steps == exp.train.steps and exp.train.il_warmup_target == 0
        else:
            assert exp.train.il_warmup_steps == 0


def test_objective_fields_cover_objective_config():
    assert set(OBJECTIVE_FIELDS) == {f.name for f in dataclasses.fields(ObjectiveConfig)}


def test_base_config_is_locked():
    c = base_config()
    with pytest.raises(AttributeError, match="gamma"):
        c.objective.gamam = 0.9


def test_misspelled_override_names_key_with_suggestion():
    with pytest.raises(ConfigError, match=r"objective\.gamam.*did you mean 'objective\.gamma'"):
        load_config(TINY, ["objective.gamam=0.9"])
    with pytest.raises(ConfigError, match=r"'trian'.*did you mean 'train'"):
        load_config(TINY, ["trian.steps=3"])


def test_unknown_key_added_by_a_config_file_is_rejected():
    c = base_config()
    with c.unlocked():
        c.optimizer.weight_decy = 0.1
    with pytest.raises(ConfigError, match=r"optimizer\.weight_decy.*did you mean 'optimizer\.weight_decay'"):
        validate(c)


@pytest.mark.parametrize(
    "override, key",
    [
        ("objective.gamma=1.5", "gamma"),
        ("objective.aggregation='sample_men'", "aggregation"),
        ("objective.trust_region_delta=-1.0", "trust_region_delta"),
        ("objective.old_logprobs='proximal'", "objective.old_logprobs"),
        ("objective.sign_by='score'", "objective.sign_by"),
        ("objective.mismatch_is_cap=0.0", "objective.mismatch_is_cap"),
        ("objective.mismatch_prob_diff=-0.1", "objective.mismatch_prob_diff"),
        ("objective.row_denominator='all'", "objective.row_denominator"),
        ("objective.baseline_stage='returns'", "objective.baseline_stage"),
        ("objective.baseline_stage='return'", "objective.baseline_stage"),  # baseline 'none': nothing to subtract
        ("optimizer.lr=0.0", "optimizer.lr"),
        ("optimizer.lr=inf", "optimizer.lr"),  # every parameter non-finite after one step
        ("optimizer.eps=inf", "optimizer.eps"),
        ("optimizer.warmup_ratio=1.5", "optimizer.warmup_ratio"),
        ("train.microbatches=3", "train.microbatches"),
        ("train.il_warmup_steps=100", "train.il_warmup_steps"),
        ("train.il_warmup_target=1.5", "train.il_warmup_target"),
        ("train.il_warmup_window=0", "train.il_warmup_window"),
        ("train.eval_every_episodes=-1", "train.eval_every_episodes"),
        ("train.max_consecutive_skipped=-1", "train.max_consecutive_skipped"),
        ("train.max_consecutive_zero_grad=-1", "train.max_consecutive_zero_grad"),
        ("queue.forced_lag=9", "queue.forced_lag"),
        ("rollout.engine='sglang'", "rollout.sglang_urls"),
        ("rollout.top_p=0.0", "rollout.top_p"),
        ("rollout.max_context=100", "rollout.max_context"),
        ("rollout.request_timeout_s=0.0", "rollout.request_timeout_s"),
        ("rollout.control_timeout_s=inf", "rollout.control_timeout_s"),
        ("rollout.outage_budget_s=-1.0", "rollout.outage_budget_s"),
        ("rollout.min_sync_servers=2", "rollout.min_sync_servers"),  # more than the pool's URLs
        ("rollout.keep_weight_folders=0", "rollout.keep_weight_folders"),
        ("rollout.seed_offset=-1", "rollout.seed_offset"),
        ("train.reward_flip_fraction=1.5", "train.reward_flip_fraction"),
        ("queue.stall_timeout_s=-5.0", "queue.stall_timeout_s"),
        ("train.reward_range=(1.0, -1.0)", "train.reward_range"),
        ("objective.baseline='group_mean'", "objective.baseline"),  # online with group_size 1
        ("model.moe_impl='fast'", "model.moe_impl"),
        ("model.remat='everything'", "model.remat"),
        ("model.moe_block_rows=-1", "model.moe_block_rows"),
        ("model.routing_replay=True", "model.routing_replay"),  # dense model
        ("model.arch.num_key_value_heads=3", "model.arch.num_key_value_heads"),
        ("mesh.data=0", "mesh.data"),
        ("checkpoint.keep=0", "checkpoint.keep"),
        ("logging.every=0", "logging.every"),
    ],
)
def test_bad_values_raise_naming_the_key(override, key):
    config = load_config(TINY, [override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        validate(config)
    assert error.value.key.endswith(key)


def test_rollout_seed_offset_moves_the_rollout_engines_sampling_seed_only(monkeypatch, tmp_path):
    """The A/A control's key: the embedded rollout engine samples with train.seed + offset, the evaluation engine
    keeps its seed; SGLang servers sample with their own seeds, so an offset there is an error."""
    from ipa_jax.pipeline import build

    seeds = []
    monkeypatch.setattr(build, "engine_mesh", lambda exp: None)
    monkeypatch.setattr(build, "engine_model", lambda exp, mesh: None)
    monkeypatch.setattr(build, "build_engine", lambda exp, kind, seed=0, **kw: seeds.append(seed))
    for offset in (0, 7):
        exp = validate(load_config(TINY, ["train.seed=3", f"rollout.seed_offset={offset}"]))
        build.build_online_engines(exp, None, str(tmp_path))
    assert seeds == [4, 3, 4, 10]
    with pytest.raises(ConfigError, match=r"rollout\.seed_offset.*own seeds"):
        validate(
            load_config(
                TINY, ["rollout.engine='sglang'", "rollout.sglang_urls=('http://h:1',)", "rollout.seed_offset=1"]
            )
        )


def test_offline_data_that_does_not_exist_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no file matches") as error:
        validate(load_config(TINY, [f"train.data=('{tmp_path}/missing*.jsonl',)"]))
    assert error.value.key == "train.data"


@pytest.mark.parametrize("eval_episodes, split, key", [(64, "eval", "train.eval_episodes"), (8, "train", "env.kwargs")])
def test_a_task_space_too_small_is_a_config_error_naming_the_minimum(eval_episodes, split, key):
    """calculator with one operation on 2..8: 7 * 3 * 7 tasks in all, split by content hash, fewer than 64 eval and
    256 train tasks; the message counts them (enumerated here, not drawn) and names what a run needs."""
    env = CalculatorEnv(ops=1, low=2, high=8)
    splits = [
        env._split_of(f"Compute {a} {op} {b}.", {"nums": [a, b], "ops": [op]})
        for a in range(2, 9)
        for op in "+-*"
        for b in range(2, 9)
    ]
    online = os.path.join(REPO, "configs", "quickstart.py")
    config = load_config(online, {"env.kwargs.ops": 1, "env.kwargs.high": 8, "train.eval_episodes": eval_episodes})
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert error.value.key == key
    assert f"its {split} split holds only {splits.count(split)} distinct tasks" in str(error.value)
    assert f"a run needs {eval_episodes} eval tasks (train.eval_episodes) and 256 train tasks" in str(error.value)


def test_two_free_mesh_axes_rejected():
    with pytest.raises(ConfigError, match="mesh"):
        validate(load_config(TINY, ["mesh.data=-1", "mesh.fsdp=-1"]))


def test_type_mismatch_in_override_names_key():
    with pytest.raises(ConfigError, match=r"train\.steps"):
        load_config(TINY, ["train.steps=abc"])


def test_preset_then_explicit_fields():
    c = load_config(TINY, ["objective.preset=flash_reinforce", "objective.trust_region_delta=1e-3"])
    assert validate(c).objective == dataclasses.replace(flash_reinforce_config(), trust_region_delta=1e-3)
    c = load_config(TINY, ["objective.preset=custom"])
    assert validate(c).objective == ObjectiveConfig()


def test_every_published_preset_and_off_policy_field_is_reachable_from_the_config():
    for name, preset in PRESETS.items():
        groups = ["rollout.group_size=2"] if preset.needs_group_ids else []  # a group baseline needs groups
        assert validate(load_config(TINY, [f"objective.preset={name}", *groups])).objective == preset
    fields = dict(
        old_logprobs="recompute",
        sign_by="reward",
        mismatch_level="sequence",
        mismatch_is_cap=1.2,
        mismatch_prob_diff=0.2,
        row_denominator="kept",
    )
    exp = validate(load_config(TINY, [f"objective.{k}={v}" for k, v in fields.items()]))
    assert exp.objective == dataclasses.replace(OBJECTIVE_PRESETS["ipa"], **fields)
    assert validate(config_from_dict(exp.to_dict())) == exp
    help_text = format_config_help()
    assert all(name in help_text for name in PRESETS)
    assert "objective.mismatch_is_cap" in help_text and "objective.row_denominator" in help_text


def test_override_parsing_and_env_kwargs(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("")
    b.write_text("")
    c = load_config(
        TINY,
        [
            "objective.mismatch_range=(0.5, 2.0)",
            "objective.is_clip_max=inf",
            f"train.data=('{a}', '{b}')",
            "checkpoint.async_save=false",
            "env.kwargs.num_hops=3",
            "env.kwargs.mode=hard",
            "objective.trust_region_delta=inf",
        ],
    )
    exp = validate(c)
    assert exp.objective.mismatch_range == (0.5, 2.0) and exp.objective.is_clip_max is None
    assert exp.objective.trust_region_delta == float("inf")
    assert exp.train.data == (str(a), str(b)) and exp.checkpoint.async_save is False
    assert dict(exp.env.kwargs) == {"num_hops": 3, "mode": "hard"}


def test_resolved_config_round_trips(tmp_path):
    c = load_config(TINY, ["objective.preset=flash_reinforce", "objective.gamma=0.9", "env.kwargs.num_hops=2"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(validate(c).to_dict()))
    again = load_config(str(path))
    assert validate(again) == validate(c)
    assert isinstance(again, ConfigDict)


def test_partial_dict_with_unknown_key_fails():
    with pytest.raises(ConfigError, match=r"train\.stpes"):
        config_from_dict({"train": {"stpes": 3}})


def test_apply_overrides_mapping():
    c = base_config()
    apply_overrides(c, {"train.steps": 7, "objective.gamma": 0.5})
    assert c.train.steps == 7 and validate(c).objective.gamma == 0.5


def test_launcher_rejects_misspelled_flag_in_one_line(tmp_path):
    # The real command line: experiments/train.py with --config.KEY=VALUE overrides.
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "experiments", "train.py"),
            f"--config={TINY}",
            "--config.objective.gamam=0.9",
            f"--config.train.run_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "objective.gamam" in lines[0] and "did you mean 'objective.gamma'" in lines[0]
    assert not (tmp_path / "run").exists()


def test_every_config_key_has_help_and_one_default():
    for name, cls in SECTIONS.items():
        helps = field_help(cls)
        missing = {f.name for f in dataclasses.fields(cls)} - {k for k, v in helps.items() if v}
        assert not missing, f"{name}: fields without a docstring entry: {missing}"
    # One source of defaults: the ConfigDict built from the sections validates to the sections' own defaults.
    exp = validate(base_config())
    assert exp == ExperimentConfig()
    assert exp.mesh == MeshConfig() and exp.objective == OBJECTIVE_PRESETS["ipa"]
    text = format_config_help(load_config(os.path.join(REPO, "configs", "quickstart.py")))
    for key in ("objective.gamma", "train.il_warmup_target", "resample.fork_jump", "model.arch.vocab_size"):
        assert key in text
    assert "640" in next(line for line in text.splitlines() if line.startswith("model.arch.vocab_size"))


def test_config_help_shows_each_objective_key_as_the_preset_sets_it():
    def shown(config, key):
        line = next(line for line in format_config_help(config).splitlines() if line.startswith(key + " "))
        return line.split()[2:4]

    for preset in ("grpo", "flash_reinforce", "ipa"):  # presets that differ in each of these keys
        config = load_config(TINY, {"objective.preset": preset})
        for name in ("baseline", "surrogate", "credit", "trust_region_level"):
            assert shown(config, f"objective.{name}") == [repr(getattr(OBJECTIVE_PRESETS[preset], name)), "(preset)"]
    # Set explicitly: the value itself, no marker.
    assert shown(load_config(TINY, {"objective.preset": "grpo", "objective.gamma": 0.5}), "objective.gamma")[0] == "0.5"


def test_config_help_flag_lists_keys(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "experiments", "train.py"), f"--config={TINY}", "--config_help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "train.steps" in proc.stdout and "optimizer updates in all" in proc.stdout


def test_config_files_load_from_any_directory_without_importing_torch(tmp_path):
    # Config files load their bases by path, so any working directory works. Nothing the launchers import before
    # loading a tokenizer imports torch (transformers' AutoTokenizer and GenerationConfig do whenever it is
    # installed, seconds of start-up for every CLI call).
    code = (
        "import sys; import ipa_jax.analysis; from ipa_jax.pipeline import load_config, validate; "
        f"print(validate(load_config({CREDIT!r})).objective); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "credit='token'" in out.stdout and out.stdout.split()[-1] == "False"


def test_learner_side_model_fields_reach_the_model_config():
    from ipa_jax.pipeline.build import model_config

    exp = validate(
        load_config(
            TINY,
            {
                "model.scan_layers": True,
                "model.moe_impl": "tokamax",
                "model.remat": "matmuls",
                "model.attention_impl": "reference",
                "model.moe_block_rows": 64,
            },
        )
    )
    qwen = model_config(exp.model)
    assert (qwen.scan_layers, qwen.moe_impl, qwen.remat_policy, qwen.attention_impl, qwen.moe_block_rows) == (
        True,
        "tokamax",
        "matmuls",
        "reference",
        64,
    )


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["objective.credit='branch'", "objective.branch_samples=0"], "objective.branch_samples"),
        (["objective.credit='branch'", "objective.branch_fraction=0.0"], "objective.branch_fraction"),
        (["objective.credit='branch'", "rollout.source='resample'"], "objective.credit"),  # needs the queue
    ],
)
def test_branch_credit_settings_are_validated(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        validate(load_config(TINY, overrides))
    assert error.value.key.endswith(key)
    exp = validate(load_config(TINY, ["objective.credit='branch'", "objective.branch_fraction=0.5"]))
    assert (exp.objective.credit, exp.objective.branch_samples, exp.objective.branch_fraction) == ("branch", 4, 0.5)
