"""Results files and the sweep around them: a seed's arms interleaved, a stopped sweep continued (finished runs kept
and skipped, also from their results files alone), and every table rebuilt from the results files without a run
folder (`tables_from_results`, `ablate.py --from_results`).

Training is a stand-in (`fake_train` in place of `ablate.train_one`) that writes a finished run folder with arm- and
seed-dependent numbers, so the sweep machinery runs in seconds; tests/analysis/test_analysis_sweep.py trains real
tiny runs."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest

from ipa_jax import analysis
from ipa_jax.analysis import sweep as ablate
from ipa_jax.analysis.curves import RunResult
from ipa_jax.analysis.presets import Preset
from ipa_jax.analysis.results import (
    config_sha,
    load_result,
    read_result,
    resolved_config,
    result_changes,
    result_path,
    write_result,
)
from ipa_jax.pipeline import ConfigError, RunFolder, load_config, validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(ROOT, "configs", "ablations")


def fake_train(config_path, overrides, log_path, train_command=None, xla_cache_dir=None, *, trained):
    """Stands in for `ablate.train_one`: writes the finished run folder a real run would (config.json,
    metrics.jsonl, summary.json, eval_tasks/ of the last evaluation with task families), its numbers depending on
    the arm and seed, and appends (config name, seed) to `trained`."""
    exp = validate(load_config(config_path, dict(overrides)))
    name, seed = os.path.basename(config_path)[:-3], exp.train.seed
    folder = RunFolder(exp.train.run_dir)
    folder.write_config(exp.to_dict())
    bonus = 1 if name.endswith("_b") else 0
    wins = [(seed + t + bonus) % 3 for t in range(6)]  # successes of 2 samples per task
    after = sum(min(w, 2) for w in wins) / 12
    with open(folder.metrics_path, "w", encoding="utf-8") as f:
        for step, success in ((2, 0.1), (4, after / 2), (6, after)):
            f.write(json.dumps({"step": step, "eval/success": success, "rl_start": 2}) + "\n")
        f.write(json.dumps({"step": 5, "admitted_fraction": 0.5 + bonus / 4}) + "\n")
    tasks = [
        {"task_id": f"t{t}", "family": "add" if t % 2 else "mul", "samples": 2, "successes": min(w, 2)}
        for t, w in enumerate(wins)
    ]
    folder.write_eval_tasks(6, {"split": "eval", "samples_per_task": 2, "tasks": tasks})
    history = [{"step": 2, "success": 0.1}, {"step": 6, "success": after}]
    folder.write_summary(
        {
            "success_before": 0.1,
            "success_after": after,
            "steps": 6,
            "seed": seed,
            "wall_time_s": 1.0,
            "il_warmup_steps": 2,
            "eval_history": history,
        }
    )
    trained.append((name, seed))


def arm_config(tmp_path, name: str, gamma: float) -> tuple[str, str]:
    path = tmp_path / f"{name}.py"
    path.write_text(
        "from ipa_jax.pipeline import load_config\n\n\ndef get_config():\n"
        f"    c = load_config({os.path.join(CONFIG_DIR, 'credit_chunk.py')!r})\n"
        f"    c.train.name = {name!r}\n    c.objective.gamma = {gamma}\n    return c\n"
    )
    return name, str(path)


@pytest.fixture
def stand_in(monkeypatch):
    trained: list[tuple[str, int]] = []
    monkeypatch.setattr(ablate, "train_one", functools.partial(fake_train, trained=trained))
    return None, lambda: list(trained)


def test_the_fingerprint_ignores_where_a_run_went_and_the_guards_that_only_stop_it():
    path = os.path.join(CONFIG_DIR, "credit_chunk.py")
    sha = config_sha(path, {"train.seed": 0, "train.run_dir": "a"})
    # A finished run computed the same under any guard value that did not stop it: its results file still applies.
    for unchanged in (
        {"train.run_dir": "b"},
        {"train.max_consecutive_zero_grad": 3},
        {"train.max_consecutive_skipped": 0},
    ):
        assert config_sha(path, {"train.seed": 0, "train.run_dir": "a", **unchanged}) == sha, unchanged
    for changed in ({"train.seed": 1}, {"objective.gamma": 0.5}, {"train.steps": 441}):
        assert config_sha(path, {"train.seed": 0, "train.run_dir": "a", **changed}) != sha, changed


def test_a_key_added_since_a_results_file_counts_only_off_its_default():
    current = resolved_config(os.path.join(CONFIG_DIR, "credit_chunk.py"), {"train.seed": 0})
    older = {k: v for k, v in current.items() if k != "train.eval_every_episodes"}  # written before the key existed
    assert current["train.eval_every_episodes"] == 0 and result_changes(older, current) == {}
    assert result_changes(older, {**current, "train.eval_every_episodes": 8}) == {"train.eval_every_episodes": (0, 8)}
    assert result_changes(current, {**current, "objective.gamma": 0.5}) == {"objective.gamma": (0.95, 0.5)}
    with pytest.raises(ConfigError, match="train.no_such_key"):  # a key removed since
        result_changes({**current, "train.no_such_key": 1}, current)


def test_run_order_puts_every_arm_in_every_position():
    arms = [(f"arm{i}", f"p{i}") for i in range(3)]
    orders = [[n for n, _ in ablate.run_order(arms, seed)] for seed in range(6)]
    assert orders[:3] == [["arm0", "arm1", "arm2"], ["arm1", "arm2", "arm0"], ["arm2", "arm0", "arm1"]]
    for position in range(3):
        assert sorted(order[position] for order in orders) == sorted(2 * ["arm0", "arm1", "arm2"])


def test_sweep_interleaves_resumes_and_rebuilds_tables_from_results(tmp_path, stand_in):
    command, trained = stand_in
    arms = [arm_config(tmp_path, "tiny_a", 0.9), arm_config(tmp_path, "tiny_b", 0.8)]
    out, results = str(tmp_path / "out"), str(tmp_path / "results")
    kwargs = dict(
        train_command=command, share_warm_start=False, results_dir=results, claim="lower", controls=(), threshold=0.2
    )
    manifest = ablate.sweep(arms, [0, 1], out, **kwargs)
    # Interleaved: seed 0 runs a then b, seed 1 b then a.
    assert trained() == [("tiny_a", 0), ("tiny_b", 0), ("tiny_b", 1), ("tiny_a", 1)]
    assert manifest["order"] == [[n, s] for n, s in trained()] and manifest["failed"] == []
    for name, path in arms:
        for seed in (0, 1):
            run_dir = os.path.join(out, "runs", name, f"seed_{seed}")
            result, head = read_result(result_path(results, name, seed))
            assert result == RunResult.from_run(run_dir)  # the file holds what the folder does
            resolved = resolved_config(path, ablate.run_overrides(run_dir, seed))
            assert head["config"] == name and head["config_sha"] == config_sha(
                path, ablate.run_overrides(run_dir, seed)
            )
            assert (
                head["config_resolved"] == resolved
                and resolved["objective.gamma"] == {"tiny_a": 0.9, "tiny_b": 0.8}[name]
            )
    table = open(os.path.join(out, "table.md"), encoding="utf-8").read()
    assert "Final held-out success per task family" in table and "| config | add | mul |" in table
    # Rerun: every run is finished, nothing trains.
    ablate.sweep(arms, [0, 1], out, **kwargs)
    assert len(trained()) == 4
    # The run folders gone (a fresh clone with the committed results): still nothing trains, same tables.
    shutil.rmtree(os.path.join(out, "runs"))
    again = ablate.sweep(arms, [0, 1], out, **kwargs)
    assert len(trained()) == 4 and again["runs"] == {} and again["failed"] == []
    assert open(os.path.join(out, "table.md"), encoding="utf-8").read() == table
    # Stopped mid-sweep (a run's results missing): its table says which seed the row lacks...
    os.remove(result_path(results, "tiny_b", 1))
    partial = str(tmp_path / "partial")
    ablate.tables_from_results(["tiny_a", "tiny_b"], [0, 1], results, partial, claim="lower", threshold=0.2)
    row = next(
        line for line in open(os.path.join(partial, "table.md"), encoding="utf-8") if line.startswith("| tiny_b")
    )
    assert row.split(" | ")[1] == "1 (missing 1)"
    assert "- tiny_b: no result of seed 1 (failed or not run): its numbers are over the other 1 of 2 seeds" in (
        open(os.path.join(partial, "table.md"), encoding="utf-8").read()
    )
    # ... and the rerun trains that run only.
    ablate.sweep(arms, [0, 1], out, **kwargs)
    assert trained()[4:] == [("tiny_b", 1)]
    # A results file of another config is never tabled under the arm's name: the run is recorded as failed, the
    # keys that differ named.
    stale = result_path(results, "tiny_a", 0)
    result, head = read_result(stale)
    resolved = head["config_resolved"]
    write_result(stale, result, "tiny_a", {**resolved, "objective.gamma": 0.5})
    shutil.rmtree(os.path.join(out, "runs"))
    failed = ablate.sweep(arms, [0, 1], out, **kwargs)["failed"]
    assert [(f["config"], f["seed"]) for f in failed] == [("tiny_a", 0)] and "different config" in failed[0]["error"]
    assert "objective.gamma: 0.5 -> 0.9" in failed[0]["error"]
    # Written before a key was added (the file lacks it): the arm's config when the key is at its default.
    write_result(stale, result, "tiny_a", {k: v for k, v in resolved.items() if k != "train.eval_every_episodes"})
    assert ablate.sweep(arms, [0, 1], out, **kwargs)["failed"] == []
    # The tables from the results alone, into a new folder: the sweep's table again.
    rebuilt = str(tmp_path / "rebuilt")
    ablate.tables_from_results(["tiny_a", "tiny_b"], [0, 1], results, rebuilt, claim="lower", threshold=0.2)
    assert open(os.path.join(rebuilt, "table.md"), encoding="utf-8").read() == table


def test_tables_from_results_equal_tables_from_run_folders(tmp_path, stand_in):
    command, _ = stand_in
    arms = [arm_config(tmp_path, name, g) for name, g in (("tiny_a", 0.9), ("tiny_b", 0.8), ("tiny_c_b", 0.7))]
    out = str(tmp_path / "out")
    ablate.sweep(arms, [0, 1, 2], out, train_command=command, share_warm_start=False, pairs={"tiny_c_b": "tiny_b"})
    manifest = analysis.load_ablation(out)
    by_folder, _ = analysis.ablation_rows(manifest["runs"], 0.2, pairs={"tiny_c_b": "tiny_b"}, resamples=200)
    files = {}
    for name, run_dirs in manifest["runs"].items():
        for d in run_dirs:
            path = result_path(str(tmp_path / "results"), name, load_result(d).seed)
            write_result(path, load_result(d), name, {})
            files.setdefault(name, []).append(path)
    by_file, _ = analysis.ablation_rows(files, 0.2, pairs={"tiny_c_b": "tiny_b"}, resamples=200)
    assert json.dumps(by_file, default=str) == json.dumps(by_folder, default=str)
    assert [r["reference"] for r in by_file] == ["tiny_a", "tiny_a", "tiny_b"]
    table = analysis.table_markdown(by_file, 0.2)
    assert "| config | vs | seeds |" in table and "| tiny_c_b | tiny_b | 3 |" in table


def test_ablate_from_results_rebuilds_each_condition(tmp_path, stand_in):
    """The tables of every condition rebuilt from the results files alone equal the sweep's, the claim family and
    the A/A control included (both in the rebuilt manifest)."""
    command, trained = stand_in
    arms = [arm_config(tmp_path, name, g) for name, g in (("tiny_a", 0.9), ("tiny_b", 0.8), ("tiny_c", 0.7))]
    results = tmp_path / "results"
    for condition in ("lo", "hi"):
        ablate.sweep(
            arms,
            [0, 1],
            str(tmp_path / "sweep" / condition),
            train_command=command,
            share_warm_start=False,
            results_dir=str(results / condition),
            claims=("tiny_b",),
            aa_controls=("tiny_c",),
        )
    preset = tmp_path / "three.py"
    preset.write_text(
        "from ipa_jax.analysis.presets import Preset\n\n\ndef get_preset():\n"
        f"    return Preset(configs=({arms[0][1]!r}, {arms[1][1]!r}, {arms[2][1]!r}), seeds=(0, 1), "
        f"conditions=(('lo', ()), ('hi', ())), claims=({arms[1][1]!r},), aa_controls=({arms[2][1]!r},))\n"
    )
    out = tmp_path / "tables"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "experiments", "ablate.py"),
        f"--preset={preset}",
        "--from_results",
        f"--results={results}",
        f"--out={out}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for condition in ("lo", "hi"):
        rebuilt = open(out / condition / "table.md", encoding="utf-8").read()
        assert rebuilt == open(tmp_path / "sweep" / condition / "table.md", encoding="utf-8").read()
        assert "| A/A: no interval |" in rebuilt  # the stand-in gives tiny_c tiny_a's outcomes
        assert "Claim family (Holm, m = 1): tiny_b, listed first;" in rebuilt
        manifest = analysis.load_ablation(str(out / condition))
        assert (manifest["claims"], manifest["aa_controls"], manifest["same_as"]) == (["tiny_b"], ["tiny_c"], {})
    assert len(trained()) == 12  # the sweeps' runs only: --from_results trains nothing
    # --effect restates the seeds needed for another effect of interest (a pilot's sizing), the rest unchanged
    proc = subprocess.run([*cmd, "--effect=0.03"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resized = open(out / "lo" / "table.md", encoding="utf-8").read()
    assert "| seeds for ±0.03 |" in resized and "seeds for ±0.05" not in resized


def test_arms_with_the_same_effective_config_run_once(tmp_path, stand_in):
    """control_il_filtered imitates only the demonstrations that succeed: at env.expert_error 0 every one does, so
    its run would repeat control_il_continue_matched's. The sweep takes that run's result instead of training it
    (its own results file, written with its own config's sha; manifest same_as), the table says so; at
    expert_error 0.5 it trains."""
    command, trained = stand_in
    matched, filtered = "control_il_continue_matched", "control_il_filtered"
    arms = [ablate.resolve_config(name, CONFIG_DIR) for name in ("credit_chunk", matched, filtered)]
    for error, same_as in ((0.0, {filtered: matched}), (0.5, {})):
        out, results, overrides = tmp_path / f"out{error}", tmp_path / f"results{error}", {"env.expert_error": error}
        before = len(trained())
        manifest = ablate.sweep(
            arms,
            [0, 1],
            str(out),
            overrides=overrides,
            train_command=command,
            share_warm_start=False,
            results_dir=str(results),
        )
        assert manifest["same_as"] == same_as and manifest["failed"] == []
        ran = {name for name, _ in trained()[before:]}
        assert ran == {"credit_chunk", matched} | ({filtered} if error else set()), error
        assert [name for name, _ in manifest["order"]][-1] == (filtered if not error else "credit_chunk")
        for seed in (0, 1):
            result, head = read_result(result_path(str(results), filtered, seed))
            run_dir = os.path.join(out, "runs", filtered, f"seed_{seed}")
            assert head["config"] == filtered
            assert head["config_resolved"] == resolved_config(
                arms[2][1], ablate.run_overrides(run_dir, seed, overrides)
            )
            assert result == read_result(result_path(str(results), matched, seed))[0]
        table = open(out / "table.md", encoding="utf-8").read()
        assert ("the runs of control_il_continue_matched (the same effective config)" in table) == (not error)
    # The rule itself: the filter counts only where the expert source could drop a failing demonstration.
    flat = ablate.resolved_flat(arms[2][1], {"env.expert_error": 0.5})
    assert "rollout.expert_successes_only" in ablate.effective_view(flat)
    for other in ({**flat, "env.expert_error": 0.0}, {**flat, "rollout.source": "queue"}):
        assert "rollout.expert_successes_only" not in ablate.effective_view(other)


def test_rerun_retrains_a_shared_warm_start_before_any_of_its_arms(tmp_path, monkeypatch):
    """With --rerun a seed's shared warm start is trained again before the first of its arms runs, whatever the
    arms' order in that seed (`run_order` puts the donor last in seed 1): no arm resumes from the old one."""
    folders: list[str] = []  # the run folder of every training, in order

    def train(config_path, overrides, *args):
        fake_train(config_path, overrides, *args, trained=[])
        folders.append(os.path.relpath(overrides["train.run_dir"], tmp_path))

    monkeypatch.setattr(ablate, "train_one", train)
    arms = [arm_config(tmp_path, "tiny_a", 0.9), arm_config(tmp_path, "tiny_b", 0.8)]  # one warm start: RL-only gamma
    ablate.sweep(arms, [0, 1], str(tmp_path), overrides={"train.il_warmup_steps": 2})
    folders.clear()
    ablate.sweep(arms, [0, 1], str(tmp_path), overrides={"train.il_warmup_steps": 2}, rerun=True)
    warm = os.path.join("warm_starts", "tiny_a")
    assert folders == [
        os.path.join(warm, "seed_0"),
        os.path.join("runs", "tiny_a", "seed_0"),
        os.path.join("runs", "tiny_b", "seed_0"),
        os.path.join(warm, "seed_1"),
        os.path.join("runs", "tiny_b", "seed_1"),
        os.path.join("runs", "tiny_a", "seed_1"),
    ]


def test_presets_check_pairs_and_conditions():
    with pytest.raises(ValueError, match="pairs"):
        Preset(("a", "b"), (0,), pairs=(("b", "c"),))
    with pytest.raises(ValueError, match="pairs"):
        Preset(("a", "b"), (0,), pairs=(("b", "b"),))
    with pytest.raises(ValueError, match="condition names"):
        Preset(("a",), (0,), conditions=(("x/y", ()),))
    with pytest.raises(ValueError, match="controls"):  # a control compared with itself
        Preset(("a", "b", "c"), (0,), pairs=(("c", "b"),), controls=("b", "c"), reference="b")
    # Claims and A/A controls: configs compared with another config, each of one kind.
    assert Preset(("a", "b", "c", "d"), (0,), claims=("b",), aa_controls=("c",), controls=("d",)).claims == ("b",)
    with pytest.raises(ValueError, match="claims .* other than the reference"):
        Preset(("a", "b"), (0,), claims=("a",))
    with pytest.raises(ValueError, match="claims .* other than the reference"):
        Preset(("a", "b"), (0,), claims=("x",))
    with pytest.raises(ValueError, match="aa_controls .* other than the reference"):
        Preset(("a", "b", "c"), (0,), pairs=(("c", "b"),), aa_controls=("b",), reference="b")
    with pytest.raises(ValueError, match="must not share a config"):
        Preset(("a", "b"), (0,), claims=("b",), aa_controls=("b",))


def test_run_preset_rejects_a_foreign_reference_and_missing_results(tmp_path):
    preset, configs = Preset(("a", "b"), (0,)), [("a", "a.py"), ("b", "b.py")]
    with pytest.raises(ConfigError, match="must be one of the configs"):
        ablate.run_preset(preset, configs, (0,), str(tmp_path), reference="c")
    with pytest.raises(ConfigError, match="needs the folder of the results files"):
        ablate.run_preset(preset, configs, (0,), str(tmp_path), from_results=True)
    with pytest.raises(ConfigError, match="run the sweep first"):
        ablate.run_preset(preset, configs, (0,), str(tmp_path), from_results=True, results=str(tmp_path / "none"))
    assert not os.listdir(tmp_path)  # nothing trained, nothing written
