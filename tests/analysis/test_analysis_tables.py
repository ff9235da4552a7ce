"""The ablation table's statistics on synthetic ablation folders: the per-config interval and the paired
difference against the reference read the runs' eval_tasks/ records (numbers recomputed here from the files with
NumPy and written-out binomial sums), run folders without per-task records fall back to seeds only and the table
says so, and the reference / claim choices show in table.md and table.csv."""

from __future__ import annotations

import csv
import json
import math
import os

import numpy as np
import pytest

from ipa_jax import analysis
from ipa_jax.pipeline import RunFolder

TASKS = 24
SEEDS = 4
FINAL_STEP = 10


def write_run(
    run_dir: str, seed: int, task_success: np.ndarray | None, rate: float | None = None, before: float = 0.1
) -> None:
    """A finished run folder: summary.json (success_before, success_after, one evaluation at FINAL_STEP),
    metrics.jsonl, config.json and, unless task_success is None (a folder from before per-task records),
    eval_tasks/ at FINAL_STEP with 2 samples per task (task_success[t] successes of 2)."""
    folder = RunFolder(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    if task_success is not None:
        rate = float(task_success.sum() / (2 * len(task_success)))
        folder.write_eval_tasks(
            FINAL_STEP,
            {
                "split": "eval",
                "samples_per_task": 2,
                "tasks": [
                    {"task_id": f"calc/eval/0/{t}", "samples": 2, "successes": int(c)}
                    for t, c in enumerate(task_success)
                ],
            },
        )
        folder.write_eval_tasks(0, {"tasks": [{"task_id": "calc/eval/0/0", "samples": 2, "successes": 0}]})
    folder.write_summary(
        {
            "success_before": before,
            "success_after": rate,
            "steps": FINAL_STEP,
            "seed": seed,
            "wall_time_s": 1.0,
            "eval_history": [{"step": 0, "success": before}, {"step": FINAL_STEP, "success": rate}],
        }
    )
    with open(folder.metrics_path, "w", encoding="utf-8") as f:
        for step, success in ((0, before), (FINAL_STEP, rate)):
            f.write(json.dumps({"step": step, "eval/success": success}) + "\n")
    folder.write_config({"train": {"il_warmup_steps": 0}})


def write_ablation(out: str, successes: dict[str, dict[int, np.ndarray | None]]) -> dict[str, list[str]]:
    runs = {}
    for name, by_seed in successes.items():
        for seed, task_success in by_seed.items():
            run_dir = os.path.join(out, "runs", name, f"seed_{seed}")
            write_run(run_dir, seed, task_success, rate=0.5)
            runs.setdefault(name, []).append(run_dir)
    return runs


@pytest.fixture
def four_seeds():
    """ref, better (fixes tasks in every seed), same (= ref): SEEDS seeds x TASKS tasks x 2 samples."""
    rng = np.random.default_rng(0)
    ref = {s: rng.integers(0, 3, TASKS) for s in range(SEEDS)}
    better = {s: np.minimum(ref[s] + (rng.random(TASKS) < 0.5), 2) for s in range(SEEDS)}
    return {"ref": ref, "better": better, "same": {s: ref[s].copy() for s in range(SEEDS)}}


def read_csv(path: str) -> dict[str, dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        return {row["config"]: row for row in csv.DictReader(f)}


def test_table_has_intervals_and_paired_differences_from_the_task_records(tmp_path, four_seeds):
    runs = write_ablation(str(tmp_path), four_seeds)
    analysis.write_tables(str(tmp_path), runs, threshold=0.5)
    table = read_csv(str(tmp_path / "table.csv"))
    ref, better = four_seeds["ref"], four_seeds["better"]
    # The difference straight from the files' numbers: mean over seeds of (arm rate - reference rate).
    expected = np.mean([(better[s].sum() - ref[s].sum()) / (2 * TASKS) for s in range(SEEDS)])
    row = table["better"]
    assert row["reference"] == "ref" and row["claim"] == "higher"
    assert float(row["diff_mean"]) == pytest.approx(expected)
    assert float(row["diff_ci_low"]) > 0 and row["verdict"] == "supported"
    assert row["diff_seeds"] == str(SEEDS) and row["diff_tasks"] == str(TASKS)
    # The t-test on the seeds' differences (scipy) with their sd floored at the task-sampling noise
    # sqrt(mean_s var_t(x_s,t) / T) (here above the sd of 4 seeds), Holm over the two comparisons (same: no
    # difference anywhere, p = 1 from the sign test).
    scipy_stats = pytest.importorskip("scipy.stats")
    d = [(better[s].sum() - ref[s].sum()) / (2 * TASKS) for s in range(SEEDS)]
    floor = np.sqrt(np.mean([np.var((better[s] - ref[s]) / 2, ddof=1) / TASKS for s in range(SEEDS)]))
    sd = max(np.std(d, ddof=1), floor)
    assert float(row["diff_sd"]) == pytest.approx(np.std(d, ddof=1)) and floor > np.std(d, ddof=1)
    assert float(row["diff_sd_floor"]) == pytest.approx(floor, rel=1e-12)
    p_value = 2 * scipy_stats.t.sf(abs(np.mean(d)) * SEEDS**0.5 / sd, SEEDS - 1)
    assert float(row["diff_p"]) == pytest.approx(p_value, rel=1e-9)
    assert float(row["diff_p_holm"]) == pytest.approx(min(1.0, 2 * p_value), rel=1e-9)
    assert (float(row["diff_ci_low"]), float(row["diff_ci_high"])) == pytest.approx(
        scipy_stats.t.interval(0.95, SEEDS - 1, loc=np.mean(d), scale=sd / SEEDS**0.5), rel=1e-9
    )
    # The detectable effect and the seeds needed at the verdict's level: 0.05 / 2 for a family of two comparisons.
    assert row["role"] == "claim" and float(row["diff_alpha"]) == pytest.approx(0.025)
    assert float(row["diff_mde"]) == pytest.approx(analysis.minimum_detectable_effect(sd, SEEDS, level=0.975))
    assert int(row["seeds_needed"]) == analysis.seeds_needed(0.05, sd, level=0.975)
    wins = sum(int((better[s] > ref[s]).sum()) for s in range(SEEDS))
    assert row["tasks_better"] == str(wins) and row["tasks_worse"] == "0"
    assert row["tasks_tied"] == str(SEEDS * TASKS - wins)
    assert float(row["sign_p_tasks"]) == pytest.approx(min(1.0, 2 * 0.5**wins), rel=1e-9)
    assert (row["seeds_better"], row["sign_p_seeds"]) == ("4", "0.125")
    # The interval is the stats module's on the same numbers (the plumbing), around the seeds' mean.
    arm = analysis.arm_estimate(
        [
            analysis.TaskOutcomes.from_records(
                [{"task_id": f"calc/eval/0/{t}", "samples": 2, "successes": c} for t, c in enumerate(better[s])]
            )
            for s in range(SEEDS)
        ]
    )
    assert (float(row["success_after_ci_low"]), float(row["success_after_ci_high"])) == pytest.approx(
        (arm.low, arm.high)
    )
    assert float(row["success_after_ci_low"]) <= float(row["success_after_mean"]) <= float(row["success_after_ci_high"])
    same = table["same"]
    assert float(same["diff_mean"]) == 0.0 and same["verdict"] == "inconclusive" and same["sign_p_tasks"] == "1.0"
    assert table["ref"]["diff_mean"] == "" and table["ref"]["verdict"] == ""
    md = open(tmp_path / "table.md", encoding="utf-8").read()
    assert "config - ref (same seeds, same tasks); verdict on the claim: config > ref" in md
    assert f"| better | {SEEDS} | {TASKS} | {expected:+.3f} | [" in md and "| supported |" in md
    assert md.count("\n| ref |") == 1  # the reference is not compared with itself
    assert "] (seeds only)" not in md and "p (Holm)" in md and "seeds for ±0.05" in md
    assert "not detected" not in md


def test_positive_controls_not_detected_are_said_in_the_verdicts(tmp_path, four_seeds):
    """A positive control is built to be worse than the reference: one that is (every seed well below) is
    detected; one that is not (the same outcomes as the reference) makes every verdict of the table say so."""
    worse = {s: np.maximum(four_seeds["ref"][s] - 1, 0) for s in range(SEEDS)}
    runs = write_ablation(str(tmp_path), {**four_seeds, "flipped": worse})
    rows, _ = analysis.ablation_rows(runs, 0.5, controls=("flipped",), resamples=200)
    by_name = {r["config"]: r for r in rows}
    assert by_name["flipped"]["verdict"] == "control detected" and by_name["better"]["verdict"] == "supported"
    assert "not detected" not in analysis.table_markdown(rows, 0.5)
    rows, _ = analysis.ablation_rows(runs, 0.5, controls=("flipped", "same"), resamples=200)
    by_name = {r["config"]: r for r in rows}
    assert by_name["same"]["verdict"] == "control NOT detected"
    assert by_name["better"]["verdict"] == "supported; positive control same not detected"
    assert "**Positive control same not detected**" in analysis.table_markdown(rows, 0.5)
    with pytest.raises(ValueError, match="positive controls"):
        analysis.ablation_rows(runs, 0.5, controls=("ref",))


def test_reference_and_claim_are_chosen(tmp_path, four_seeds):
    runs = write_ablation(str(tmp_path), four_seeds)
    rows, _ = analysis.ablation_rows(runs, 0.5, reference="better", claim="lower", resamples=500)
    by_name = {r["config"]: r for r in rows}
    assert by_name["ref"]["verdict"] == "supported"  # ref is below better, as claimed
    assert by_name["ref"]["diff_mean"] < 0 and math.isnan(by_name["better"]["diff_mean"])
    md = analysis.table_markdown(rows, 0.5)
    assert "verdict on the claim: config < better" in md
    with pytest.raises(ValueError, match="no finished run"):
        analysis.ablation_rows(runs, 0.5, reference="missing")
    with pytest.raises(ValueError, match="claim must be one of"):
        analysis.ablation_rows(runs, 0.5, claim="better")


def test_old_run_folders_fall_back_to_seeds_and_the_table_says_so(tmp_path, four_seeds):
    successes = {**four_seeds, "old": {0: None, 1: None}}
    runs = write_ablation(str(tmp_path), successes)
    analysis.write_tables(str(tmp_path), runs, threshold=0.5)
    table = read_csv(str(tmp_path / "table.csv"))
    old = table["old"]
    assert old["ci_resampled"] == "seeds" and old["diff_seeds"] == "2"
    assert old["tasks_better"] == "" and old["sign_p_tasks"] == ""
    ref_rates = [four_seeds["ref"][s].sum() / (2 * TASKS) for s in (0, 1)]
    assert float(old["diff_mean"]) == pytest.approx(np.mean([0.5 - r for r in ref_rates]))
    md = open(tmp_path / "table.md", encoding="utf-8").read()
    assert "] (seeds only)" in md
    assert (
        "- old: run folders without per-task records: seeds resampled, tasks not; run folders without per-task "
        "records: no task sign test\n" in md
    )
    # One seed without records: no interval, and the table says why instead of printing nan.
    one = write_ablation(str(tmp_path / "one"), {"a": {0: None}, "b": {0: None}})
    rows, _ = analysis.ablation_rows(one, 0.5, resamples=200)
    md = analysis.table_markdown(rows, 0.5)
    assert "nan" not in md and "one seed: no interval" in md and "| b | 1 | 0 | +0.000 | - |" in md


def test_final_outcomes_read_the_last_evaluation(tmp_path):
    run_dir = str(tmp_path / "run")
    write_run(run_dir, seed=4, task_success=np.array([2, 1, 0]))
    seed, run = analysis.final_outcomes(run_dir)
    assert seed == 4 and run.per_task and run.successes.tolist() == [2.0, 1.0, 0.0] and run.rate == 0.5
    assert RunFolder(run_dir).eval_tasks_steps() == [0, FINAL_STEP]


def test_collapsed_runs_are_counted_per_config(tmp_path):
    # (warm start, final) per seed: below half the warm start's success is a collapse; half exactly, or a warm start
    # at 0, is not.
    arms = {"a": [(0.6, 0.2), (0.6, 0.3), (0.0, 0.0)], "b": [(0.5, 0.0), (0.4, 0.1), (0.3, 0.7)]}
    runs = {}
    for name, seeds in arms.items():
        for seed, (before, after) in enumerate(seeds):
            run_dir = str(tmp_path / "runs" / name / f"seed_{seed}")
            write_run(run_dir, seed, None, rate=after, before=before)
            runs.setdefault(name, []).append(run_dir)
    analysis.write_tables(str(tmp_path), runs, threshold=0.5)
    table = read_csv(str(tmp_path / "table.csv"))
    assert (table["a"]["collapsed"], table["b"]["collapsed"]) == ("1", "2")
    with open(tmp_path / "runs.csv", encoding="utf-8") as f:
        per_run = [(r["config"], float(r["collapsed"])) for r in csv.DictReader(f)]
    assert per_run == [("a", 1.0), ("a", 0.0), ("a", 0.0), ("b", 1.0), ("b", 1.0), ("b", 0.0)]
    md = open(tmp_path / "table.md", encoding="utf-8").read()
    assert "| collapsed |" in md and "| 1/3 |" in md and "| 2/3 |" in md
    assert f"below {analysis.COLLAPSE_FRACTION:g} x their warm start's" in md


def holm_of_three(p: list[float]) -> list[float]:
    """Holm's adjustment of three p-values written out: 3 p_(1), then max(that, 2 p_(2)), then max(that, p_(3))."""
    order = np.argsort(p)
    adjusted, running = [0.0] * 3, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (3 - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def test_the_claim_family_is_the_preregistered_claims_and_controls_stand_beside_it(tmp_path):
    """8 seeds: three pre-registered claims (Holm over those three only, their detectable effect at 0.05 / 3), a
    descriptive arm, a positive control (detected at the unadjusted 0.05) and two A/A arms (one the reference with
    a few outcomes moved either way, one far better: its interval excludes 0). The Markdown table lists the
    family first."""
    rng = np.random.default_rng(5)
    seeds = range(8)
    ref = {s: rng.integers(0, 3, TASKS) for s in seeds}

    def fixes(share: float) -> dict[int, np.ndarray]:
        return {s: np.minimum(ref[s] + (rng.random(TASKS) < share), 2) for s in seeds}

    arms = {"ref": ref, "a": fixes(0.5), "b": fixes(0.3), "c": fixes(0.1), "d": fixes(0.2)}
    arms["flip"] = {s: np.maximum(ref[s] - 1, 0) for s in seeds}
    arms["aa"] = {s: np.clip(ref[s] + rng.choice([-1, 0, 0, 0, 0, 0, 1], TASKS), 0, 2) for s in seeds}
    arms["aa_off"] = fixes(0.6)
    runs = write_ablation(str(tmp_path), arms)
    kinds = dict(controls=("flip",), aa_controls=("aa", "aa_off"), resamples=200)
    rows, _ = analysis.ablation_rows(runs, 0.5, claims=("a", "b", "c"), **kinds)
    by_name = {r["config"]: r for r in rows}
    assert [by_name[n]["role"] for n in ("a", "b", "c", "d", "flip", "aa")] == [
        *["claim"] * 3,
        "descriptive",
        "positive control",
        "A/A",
    ]
    family = [by_name[n]["diff_p"] for n in ("a", "b", "c")]
    assert [by_name[n]["diff_p_holm"] for n in ("a", "b", "c")] == pytest.approx(holm_of_three(family), rel=1e-12)
    assert by_name["a"]["verdict"] == "supported"
    d = by_name["d"]
    assert math.isnan(d["diff_p_holm"]) and d["verdict"] == "descriptive (not in the claim family)"
    assert by_name["flip"]["verdict"] == "control detected" and by_name["flip"]["diff_p"] < 0.05
    assert by_name["aa"]["verdict"] == "A/A: interval covers 0"
    assert by_name["aa_off"]["verdict"] == "A/A: interval excludes 0 (noise underestimated)"
    # The detectable effect at the verdict's level: 0.05 / 3 for a claim, from the sd the interval uses (the seeds'
    # sd or its task-sampling floor, written out here); larger than at 0.05 alone (a family of one).
    a_diff = [(arms["a"][s] - ref[s]) / 2 for s in seeds]
    spread = max(
        np.std([x.mean() for x in a_diff], ddof=1), np.sqrt(np.mean([np.var(x, ddof=1) / TASKS for x in a_diff]))
    )
    three = analysis.minimum_detectable_effect(spread, 8, level=1 - 0.05 / 3)
    assert by_name["a"]["diff_alpha"] == pytest.approx(0.05 / 3) and by_name["d"]["diff_alpha"] == pytest.approx(0.05)
    assert by_name["a"]["diff_mde"] == pytest.approx(three, rel=1e-12)
    alone, _ = analysis.ablation_rows(runs, 0.5, claims=("a",), **kinds)
    assert next(r for r in alone if r["config"] == "a")["diff_mde"] == pytest.approx(
        analysis.minimum_detectable_effect(spread, 8), rel=1e-12
    )
    assert analysis.minimum_detectable_effect(spread, 8) < three
    md = analysis.table_markdown(rows, 0.5)
    assert "Claim family (Holm, m = 3): a, b, c, listed first; the other rows are judged alone, at 0.05." in md
    order = [line.split(" | ")[0][2:] for line in md.split("Claim family")[1].splitlines() if line.startswith("| ")]
    assert order[1:] == ["a", "b", "c", "d", "flip", "aa", "aa_off"]
    assert "**A/A control aa_off: interval excludes 0**" in md
