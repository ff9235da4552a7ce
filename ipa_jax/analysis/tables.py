"""Ablation folders (written by `ipa_jax.analysis.sweep`): the manifest, the comparison tables and the plots.

An ablation folder holds `ablation.json` = {"configs": {name: config path}, "seeds": [...], "runs": {name:
[run_dir, ...]}, "threshold": float, "reference": name, "claim": "higher" | "lower", ...}, the run folders under
runs/<name>/seed_<s>, table.md, table.csv, runs.csv and the PNG plots. The tables hold per config the mean and
sample std over seeds of the per-run numbers, the final success's confidence interval over seeds and held-out
tasks, and its paired difference with a reference config (`ipa_jax.analysis.stats`, docs/statistics.md). Plot
functions draw on a matplotlib Axes given by the caller (pyplot in a notebook, a bare Figure in write_plots), so
this module never picks a matplotlib backend.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ipa_jax.analysis.curves import COLLAPSE_FRACTION, EVAL_SUCCESS, SCALARS, RunResult, seed_band, series, smooth
from ipa_jax.analysis.results import load_result
from ipa_jax.analysis.stats import (
    CLAIMS,
    DEFAULT_EFFECT,
    DEFAULT_LEVEL,
    DEFAULT_POWER,
    DEFAULT_RESAMPLES,
    SEEDS_ONLY,
    PairedDifference,
    SignTest,
    arm_estimate,
    holm,
    paired_difference,
    seeds_needed,
    verdict,
)
from ipa_jax.pipeline import RunFolder

CONTROL_DETECTED, CONTROL_MISSED = "control detected", "control NOT detected"  # a positive control's verdict
AA_COVERS, AA_EXCLUDES, AA_NO_INTERVAL = (  # an A/A control's verdict
    "A/A: interval covers 0",
    "A/A: interval excludes 0 (noise underestimated)",
    "A/A: no interval",
)
DESCRIPTIVE = "descriptive (not in the claim family)"  # the verdict of a comparison outside the Holm family
# A row's part in the table: its comparison is a claim (Holm family), descriptive, or a control; or it is compared
# with nothing (a reference, or no seed in common).
CLAIM, DESCRIBED, POSITIVE_CONTROL, AA_CONTROL, NOT_COMPARED = "claim", "descriptive", "positive control", "A/A", ""


def load_ablation(ablation_dir: str) -> dict[str, Any]:
    """<ablation_dir>/ablation.json, with run folders and results files made absolute (they are stored relative to the
    folder)."""
    path = os.path.join(ablation_dir, "ablation.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{ablation_dir}: no ablation.json (not an ablation folder)")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    for key in ("runs", "results"):  # results: the runs' results files (ipa_jax.analysis.results), when written
        manifest[key] = {
            name: [os.path.normpath(os.path.join(ablation_dir, d)) for d in paths]
            for name, paths in manifest.get(key, {}).items()
        }
    return manifest


def ablation_reference(manifest: dict[str, Any]) -> str:
    """The config the differences are taken against: the manifest's reference when it has finished runs (run
    folders, or results files when it has them), else (an older manifest without one, or every reference run failed)
    the first config with finished runs."""
    runs = manifest.get("results") or manifest["runs"]  # results files, when the sweep wrote them
    if not runs:
        raise ValueError("the ablation has no finished run")
    reference = manifest.get("reference")
    return reference if reference in runs else next(iter(runs))


def manifest_comparison(manifest: dict[str, Any], reference: str = "", claim: str = "") -> dict[str, Any]:
    """The comparison an ablation folder's manifest (`load_ablation`) records, as keywords of `ablation_rows` and
    `write_tables`: its reference (`ablation_reference`; `reference` overrides it), claim (`claim` overrides it),
    effect of interest, pairs, and the claims, positive controls and A/A controls among its configs with finished
    runs that are compared with another config; same_as (arms that took another arm's runs)."""
    runs = manifest.get("results") or manifest["runs"]
    reference = reference or ablation_reference(manifest)
    pairs = {k: v for k, v in (manifest.get("pairs") or {}).items() if k in runs and v in runs}

    def compared(key: str) -> list[str]:
        return [c for c in manifest.get(key, ()) if c in runs and c != pairs.get(c, reference)]

    return dict(
        reference=reference,
        claim=claim or manifest.get("claim", "higher"),
        controls=compared("controls"),
        effect=manifest.get("effect", DEFAULT_EFFECT),
        pairs=pairs,
        claims=compared("claims"),
        aa_controls=compared("aa_controls"),
        same_as=manifest.get("same_as"),
        planned_seeds=manifest.get("seeds", ()),
    )


def newest_ablation(root: str = os.path.join("runs", "ablations")) -> str:
    """The ablation folder under `root` (searched recursively) whose ablation.json changed last."""
    paths = glob.glob(os.path.join(root, "**", "ablation.json"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no ablation folder (with ablation.json) under {os.path.abspath(root)}")
    return os.path.dirname(max(paths, key=os.path.getmtime))


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1) over the finite values; std nan with fewer than two."""
    finite = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    if finite.size == 0:
        return math.nan, math.nan
    return float(finite.mean()), float(finite.std(ddof=1)) if finite.size > 1 else math.nan


def comparison_columns(
    runs: dict[str, list[str]],
    *,
    reference: str | None = None,
    claim: str = "higher",
    resamples: int = DEFAULT_RESAMPLES,
    controls: Sequence[str] = (),
    effect: float = DEFAULT_EFFECT,
    pairs: Mapping[str, str] | None = None,
    results: Mapping[str, RunResult] | None = None,
    claims: Sequence[str] = (),
    aa_controls: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """Per config, the statistics of its final held-out success (`RunResult.outcomes` of each run: a run folder or a
    results file, `load_result`; `results`: those already loaded, by path), paired by train seed:

    success_after_ci_low / _high, ci_resampled: the 95% hierarchical-bootstrap interval of the mean over seeds
    (`arm_estimate`; ci_resampled "seeds, tasks", or "seeds" for run folders without per-task records);
    reference, claim, role, diff_*: its paired difference with its reference (`pairs`: {config: the config it
    differs from by one change}; the others: `reference`, default the first config) over their common seeds
    (`paired_difference`): diff_mean, diff_ci_low / _high (the t-interval over the seeds' differences),
    diff_sd (their std), diff_sd_floor (its task-sampling floor), diff_p (paired t-test), diff_p_holm
    (Holm-adjusted across the claim family), diff_alpha (the level the next two are stated at), diff_mde
    (minimum detectable effect at 80% power), seeds_needed (for a true difference of `effect`), diff_seeds,
    diff_tasks, the sign tests over (seed, task) pairs (descriptive: tasks_better / _worse / _tied, sign_p_tasks)
    and over seeds (seeds_better / _worse / _tied, sign_p_seeds), and verdict.

    role and verdict: the claim family is `claims` (pre-registered comparisons; empty: every compared config but
    the controls), role CLAIM, judged on `claim` ("higher": the config beats its reference) at the Holm-adjusted p,
    their detectable effect and seeds stated at 0.05 / m for the family's m comparisons (Holm's first step); every
    other row is judged alone, at 0.05: a config of `controls` (positive controls, built to be worse than the
    reference) detected or not, one of `aa_controls` (A/A controls, the reference again) by whether its interval
    covers 0, any other config DESCRIPTIVE. The claims' and the descriptive verdicts say when a positive control was
    not detected. nan / None for the reference itself and for a config without a seed in common with it; note: what
    the intervals leave out."""
    if claim not in CLAIMS:
        raise ValueError(f"claim must be one of {CLAIMS}, got {claim!r}")
    reference = next(iter(runs), None) if reference is None else reference
    if reference not in runs:
        raise ValueError(f"reference {reference!r} has no finished run (configs with runs: {', '.join(runs)})")
    reference_of = {name: (pairs or {}).get(name, reference) for name in runs}
    missing = {name: ref for name, ref in reference_of.items() if ref not in runs}
    if missing:
        raise ValueError(f"paired references without a finished run: {missing} (configs with runs: {', '.join(runs)})")
    for kind, names in (("positive controls", controls), ("claims", claims), ("A/A controls", aa_controls)):
        unknown = [name for name in names if name == reference_of.get(name) or name not in runs]
        if unknown:
            raise ValueError(
                f"{kind} {unknown} must be configs with runs other than their reference "
                f"{reference!r} (configs with runs: {', '.join(runs)})"
            )
    results = dict(results or {})
    outcomes = {}
    for name, run_dirs in runs.items():
        loaded = [results.get(d) or load_result(d) for d in run_dirs]
        by_seed = {r.seed: r.outcomes() for r in loaded}
        if len(by_seed) != len(run_dirs):
            raise ValueError(f"{name}: two runs share a train seed ({run_dirs})")
        outcomes[name] = by_seed
    role_of = {name: POSITIVE_CONTROL for name in controls} | {name: AA_CONTROL for name in aa_controls}
    columns, differences = {}, {}
    for name, by_seed in outcomes.items():
        ref = reference_of[name]
        arm = arm_estimate(list(by_seed.values()), resamples=resamples)
        row: dict[str, Any] = {
            "success_after_ci_low": arm.low,
            "success_after_ci_high": arm.high,
            "ci_resampled": arm.resampled,
            "reference": ref,
            "claim": claim,
            "role": NOT_COMPARED,
        }
        notes = [arm.note]
        if name == ref or not set(by_seed) & set(outcomes[ref]):
            row.update(_no_difference())
            if name != ref:
                notes.append(f"no seed in common with {ref}")
        else:
            diff = differences[name] = paired_difference(outcomes[ref], by_seed)
            row.update(
                role=role_of.get(name, CLAIM if name in claims or not claims else DESCRIBED),
                diff_mean=diff.mean,
                diff_ci_low=diff.low,
                diff_ci_high=diff.high,
                diff_sd=diff.sd,
                diff_sd_floor=diff.sd_floor,
                diff_p=diff.p_value,
                diff_p_holm=math.nan,
                diff_alpha=math.nan,
                diff_mde=math.nan,
                seeds_needed=None,
                diff_seeds=diff.seeds,
                diff_tasks=diff.tasks,
                **_sign_columns("tasks", diff.tasks_sign),
                **_sign_columns("seeds", diff.seeds_sign),
                verdict="",
            )  # the family's columns filled once every comparison is known
            notes.append(diff.note)
        parts = [part for note in notes if note for part in note.split("; ")]
        row["note"] = "; ".join(dict.fromkeys(parts))  # the arm's and the difference's notes, each said once
        columns[name] = row
    family = [name for name in differences if columns[name]["role"] == CLAIM]
    adjusted = dict(zip(family, holm([differences[name].p_value for name in family])))
    alpha = 1.0 - DEFAULT_LEVEL
    family_alpha = alpha / max(1, sum(math.isfinite(p) for p in adjusted.values()))
    for name, diff in differences.items():
        row = columns[name]
        row["diff_alpha"] = family_alpha if name in adjusted else alpha
        row["diff_mde"] = diff.minimum_detectable_effect(level=1.0 - row["diff_alpha"])
        row["seeds_needed"] = seeds_needed(effect, diff.sd_used, level=1.0 - row["diff_alpha"])
        row["diff_p_holm"] = adjusted.get(name, math.nan)
        row["verdict"] = _verdict(row["role"], diff, adjusted.get(name, diff.p_value), claim)
    missed = [name for name in controls if columns[name]["verdict"] != CONTROL_DETECTED]
    if missed:
        for row in columns.values():
            if row["role"] in (CLAIM, DESCRIBED):
                row["verdict"] += f"; positive control {', '.join(missed)} not detected"
    return columns


def _verdict(role: str, diff: PairedDifference, p_value: float, claim: str) -> str:
    """A compared row's verdict from its `role`, its paired difference and its p-value (Holm-adjusted for a claim)."""
    significant = p_value < 1.0 - DEFAULT_LEVEL
    if role == CLAIM:
        return verdict(diff.mean, diff.mean, claim) if significant else "inconclusive"
    if role == POSITIVE_CONTROL:
        return CONTROL_DETECTED if significant and diff.mean < 0 else CONTROL_MISSED
    if role == AA_CONTROL:
        if not (math.isfinite(diff.low) and math.isfinite(diff.high)):
            return AA_NO_INTERVAL
        return AA_COVERS if diff.low <= 0.0 <= diff.high else AA_EXCLUDES
    return DESCRIPTIVE


def _sign_columns(unit: str, test: SignTest | None) -> dict[str, Any]:
    """<unit>_better / _worse / _tied and sign_p_<unit> of a sign test (None / nan without one)."""
    if test is None:
        return {f"{unit}_better": None, f"{unit}_worse": None, f"{unit}_tied": None, f"sign_p_{unit}": math.nan}
    return {
        f"{unit}_better": test.positive,
        f"{unit}_worse": test.negative,
        f"{unit}_tied": test.ties,
        f"sign_p_{unit}": test.p_value,
    }


def _no_difference() -> dict[str, Any]:
    """The paired-difference columns of a config not compared (the reference, or no common seed)."""
    return {
        "diff_mean": math.nan,
        "diff_ci_low": math.nan,
        "diff_ci_high": math.nan,
        "diff_sd": math.nan,
        "diff_sd_floor": math.nan,
        "diff_p": math.nan,
        "diff_p_holm": math.nan,
        "diff_alpha": math.nan,
        "diff_mde": math.nan,
        "seeds_needed": None,
        "diff_seeds": 0,
        "diff_tasks": 0,
        **_sign_columns("tasks", None),
        **_sign_columns("seeds", None),
        "verdict": "",
    }


def ablation_rows(
    runs: dict[str, list[str]],
    threshold: float,
    *,
    reference: str | None = None,
    claim: str = "higher",
    resamples: int = DEFAULT_RESAMPLES,
    controls: Sequence[str] = (),
    effect: float = DEFAULT_EFFECT,
    pairs: Mapping[str, str] | None = None,
    claims: Sequence[str] = (),
    aa_controls: Sequence[str] = (),
    same_as: Mapping[str, str] | None = None,
    planned_seeds: Sequence[int] = (),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per-config rows, per-run rows) of runs given as run folders or results files (`load_result`). A per-config
    row holds n_seeds, <scalar>_mean and <scalar>_std for each of SCALARS (over seeds), threshold_reached = how many
    seeds reached `threshold` (steps_to_threshold is averaged over those only), collapsed = how many seeds collapsed
    (`RunResult.scalars`), family_<f>_success_mean / _std per task family of the final evaluation (with several
    families), and the `comparison_columns` of its final success against its reference (`reference`, or its
    entry in `pairs`; with the `claims` family, the positive `controls`, the `aa_controls` and the `effect` of
    interest); a config of `same_as` ({config: the config whose runs it took, the same effective config}) says so
    in its note, and so does a config without the result of some of the `planned_seeds` (missing_seeds: those)."""
    loaded = {d: load_result(d) for run_dirs in runs.values() for d in run_dirs}
    config_rows, run_rows = [], []
    comparison = (
        comparison_columns(
            runs,
            reference=reference,
            claim=claim,
            resamples=resamples,
            controls=controls,
            effect=effect,
            pairs=pairs,
            results=loaded,
            claims=claims,
            aa_controls=aa_controls,
        )
        if runs
        else {}
    )
    for name, twin in (same_as or {}).items():
        if name in comparison:
            _prefix_note(comparison[name], f"the runs of {twin} (the same effective config)")
    families = sorted({f for r in loaded.values() for f in r.success_by_family()})
    for name, run_dirs in runs.items():
        per_run = [loaded[d].scalars(threshold) for d in run_dirs]
        for d, scalars in zip(run_dirs, per_run):
            run_rows.append({"config": name, "run_dir": d, **scalars})
        ran = {loaded[d].seed for d in run_dirs}
        lost = [seed for seed in planned_seeds if seed not in ran]
        row: dict[str, Any] = {"config": name, "n_seeds": len(per_run), "missing_seeds": " ".join(map(str, lost))}
        for key in SCALARS:
            row[f"{key}_mean"], row[f"{key}_std"] = _mean_std([s[key] for s in per_run])
        row["threshold_reached"] = sum(math.isfinite(s["steps_to_threshold"]) for s in per_run)
        row["collapsed"] = int(sum(s["collapsed"] for s in per_run))
        for family in families if len(families) > 1 else ():
            rates = [loaded[d].success_by_family().get(family, math.nan) for d in run_dirs]
            row[f"family_{family}_success_mean"], row[f"family_{family}_success_std"] = _mean_std(rates)
        if lost:  # never a silent survivor table: a seed lost to its arm's own failure would flatter the arm
            _prefix_note(
                comparison[name],
                f"no result of seed{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} (failed or not run): "
                f"its numbers are over the other {len(per_run)} of {len(planned_seeds)} seeds",
            )
        config_rows.append({**row, **comparison[name], "effect": effect})
    return config_rows, run_rows


def _prefix_note(row: dict[str, Any], text: str) -> None:
    row["note"] = f"{text}; {row['note']}" if row["note"] else text


def _fmt(mean: float, std: float, digits: int) -> str:
    if not math.isfinite(mean):
        return "-"
    return f"{mean:.{digits}f}" if not math.isfinite(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _interval(low: float, high: float, resampled: str, signed: bool = False) -> str:
    """[low, high] (3 decimals, `signed`: with +), "(seeds only)" when tasks were not resampled; "-" without one."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return "-"
    number = "{:+.3f}" if signed else "{:.3f}"
    cell = f"[{number.format(low)}, {number.format(high)}]"
    return cell + " (seeds only)" if resampled == SEEDS_ONLY else cell


def _counts(row: dict[str, Any], unit: str) -> str:
    if row[f"{unit}_better"] is None:
        return "-"
    return f"{row[f'{unit}_better']} / {row[f'{unit}_worse']} / {row[f'{unit}_tied']}"


def _p(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.3g}"


def table_markdown(rows: Sequence[dict[str, Any]], threshold: float) -> str:
    """The per-config rows (`ablation_rows`) as Markdown: mean ± sample std over seeds and the final success's 95%
    interval per config, then the paired differences of final success against the reference config (interval,
    t-test p raw and Holm-adjusted, the level α of the detectable effect and of the seeds the effect of interest
    needs, descriptive sign tests, verdict; the claim family's rows first, then the descriptive ones and the
    controls), a line when a positive control was not detected or an A/A control's interval excludes 0, then notes
    on what the intervals cover."""
    level = f"{DEFAULT_LEVEL:.0%}"
    header = [
        "config",
        "seeds",
        "success before",
        "success after",
        f"{level} CI",
        "AUC success",
        f"RL steps to {threshold:g}",
        "collapsed",
        "wall time (s)",
        "admitted",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        reached = (
            f"{_fmt(r['steps_to_threshold_mean'], r['steps_to_threshold_std'], 0)} "
            f"({r['threshold_reached']}/{r['n_seeds']})"
        )
        cells = [
            r["config"],
            str(r["n_seeds"]) + (f" (missing {r['missing_seeds']})" if r["missing_seeds"] else ""),
            _fmt(r["success_before_mean"], r["success_before_std"], 3),
            _fmt(r["success_after_mean"], r["success_after_std"], 3),
            _interval(r["success_after_ci_low"], r["success_after_ci_high"], r["ci_resampled"]),
            _fmt(r["auc_mean"], r["auc_std"], 3),
            reached,
            f"{r['collapsed']}/{r['n_seeds']}",
            _fmt(r["wall_time_s_mean"], r["wall_time_s_std"], 0),
            _fmt(r["admitted_fraction_mean"], r["admitted_fraction_std"], 3),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if not rows:
        return "\n".join(lines) + "\n"
    reference, claim, effect = rows[0]["reference"], rows[0]["claim"], rows[0]["effect"]
    sign = ">" if claim == "higher" else "<"
    power = f"{DEFAULT_POWER:.0%}"
    # The decision first (the claim family), then the rows judged alone; each kind in config order.
    order = (CLAIM, DESCRIBED, POSITIVE_CONTROL, AA_CONTROL, NOT_COMPARED)
    compared = sorted((r for r in rows if r["config"] != r["reference"]), key=lambda r: order.index(r["role"]))
    paired = any(r["reference"] != reference for r in compared)  # some configs differ from another reference
    versus = "its reference (vs)" if paired else reference
    alpha = f"{1 - DEFAULT_LEVEL:.2g}"
    family = [r["config"] for r in compared if r["role"] == CLAIM]
    lines += [
        "",
        f"Paired difference in final held-out success, config - {versus} (same seeds, same tasks); "
        f"verdict on the claim: config {sign} {versus}",
    ]
    if len(family) < len(compared):
        lines += [
            "",
            f"Claim family (Holm, m = {len(family)}): {', '.join(family) or 'none'}, listed first; "
            f"the other rows are judged alone, at {alpha}.",
        ]
    lines += [
        "",
        "| config | " + ("vs | " if paired else "") + f"seeds | tasks | Δ success | {level} CI | p (t) | p (Holm) | "
        f"α | detectable at {power} | seeds for ±{effect:g} | seeds + / - / = | sign test p (seeds) | "
        "tasks + / - / = | sign test p (tasks) | verdict |",
        "|" + "---|" * (16 if paired else 15),
    ]
    for r in compared:
        cells = [
            r["config"],
            *([r["reference"]] if paired else []),
            str(r["diff_seeds"]),
            str(r["diff_tasks"]),
            "-" if not math.isfinite(r["diff_mean"]) else f"{r['diff_mean']:+.3f}",
            _interval(r["diff_ci_low"], r["diff_ci_high"], "", signed=True),
            _p(r["diff_p"]),
            _p(r["diff_p_holm"]),
            _p(r["diff_alpha"]),
            "-" if not math.isfinite(r["diff_mde"]) else f"{r['diff_mde']:.3f}",
            "-" if r["seeds_needed"] is None else str(r["seeds_needed"]),
            _counts(r, "seeds"),
            _p(r["sign_p_seeds"]),
            _counts(r, "tasks"),
            _p(r["sign_p_tasks"]),
            r["verdict"] or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _family_table(rows)
    missed = [r["config"] for r in rows if r["verdict"] == CONTROL_MISSED]
    if missed:
        lines += [
            "",
            f"**Positive control {', '.join(missed)} not detected**: this table cannot detect effects of "
            'that size; read its inconclusive verdicts as "too few seeds", not "no effect".',
        ]
    noisy = [r["config"] for r in rows if r["verdict"] == AA_EXCLUDES]
    if noisy:
        lines += [
            "",
            f"**A/A control {', '.join(noisy)}: interval excludes 0**: the same config differs from itself by "
            "more than the intervals allow; they understate the noise.",
        ]
    lines += [
        "",
        f"{level} CI (success): percentile interval of a hierarchical bootstrap (seeds, then held-out tasks "
        'within each seed), so it includes seed-to-seed training variance; "(seeds only)": no per-task '
        f"records, seeds resampled only. {level} CI (Δ): t-interval over the seeds' paired differences "
        "(mean ± t_{0.975, n-1} sd / sqrt(n), sd no smaller than the task-sampling noise of the differences; "
        "none without any spread, p then from the sign test over seeds); p (t): the paired t-test; p (Holm): "
        f"adjusted across the claim family. Verdict: for a claim, supported / contradicted when p (Holm) < {alpha} "
        f"with Δ on the claimed / the other side of 0, else inconclusive; outside the family: a positive "
        f"control is detected when p (t) < {alpha} with Δ < 0, an A/A control's interval should cover 0, other "
        f"rows are descriptive. Detectable at {power}: the true Δ a two-sided paired t-test at α over these "
        f"seeds finds with {power} probability, given the seeds' spread; seeds for ±{effect:g}: the seeds that "
        f"effect would need; α = {alpha} / m for the m claims (Holm's first and strictest step, Bonferroni: "
        f"conservative), {alpha} for the other rows. The sign tests are descriptive (the task one treats tasks "
        "within seeds as independent), not part of the verdict. Collapsed: seeds whose final success fell below "
        f"{COLLAPSE_FRACTION:g} x their warm start's. See docs/statistics.md.",
    ]
    lines += [f"- {r['config']}: {r['note']}" for r in rows if r["note"]]
    return "\n".join(lines) + "\n"


def _family_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines: final held-out success per task family (mean ± std over seeds) per config; none with a
    single family."""
    families = [
        k[len("family_") : -len("_success_mean")] for k in rows[0] if k.startswith("family_") and k.endswith("_mean")
    ]
    if not families:
        return []
    lines = ["", "Final held-out success per task family (mean ± std over seeds)", ""]
    lines += ["| config | " + " | ".join(families) + " |", "|" + "---|" * (len(families) + 1)]
    for r in rows:
        cells = [_fmt(r[f"family_{f}_success_mean"], r[f"family_{f}_success_std"], 3) for f in families]
        lines.append("| " + " | ".join([r["config"], *cells]) + " |")
    return lines


def write_csv(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """Rows (dicts with the same keys) as CSV; non-finite numbers as empty cells."""
    if not rows:
        raise ValueError(f"{path}: no rows to write")
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()})


def write_tables(
    ablation_dir: str,
    runs: dict[str, list[str]],
    threshold: float,
    *,
    reference: str | None = None,
    claim: str = "higher",
    controls: Sequence[str] = (),
    effect: float = DEFAULT_EFFECT,
    pairs: Mapping[str, str] | None = None,
    claims: Sequence[str] = (),
    aa_controls: Sequence[str] = (),
    same_as: Mapping[str, str] | None = None,
    planned_seeds: Sequence[int] = (),
) -> list[dict[str, Any]]:
    """table.md, table.csv (per config; differences against `reference`, default the first config, or the config's
    entry in `pairs`, verdicts on `claim` over the `claims` family, the positive `controls` and the `aa_controls`
    checked, seeds stated for the `effect` of interest, `same_as` and seeds missing of `planned_seeds` noted:
    `ablation_rows`) and runs.csv (per run) in `ablation_dir`, from run folders or results files; returns the
    per-config rows."""
    config_rows, run_rows = ablation_rows(
        runs,
        threshold,
        reference=reference,
        claim=claim,
        controls=controls,
        effect=effect,
        pairs=pairs,
        claims=claims,
        aa_controls=aa_controls,
        same_as=same_as,
        planned_seeds=planned_seeds,
    )
    with open(os.path.join(ablation_dir, "table.md"), "w", encoding="utf-8") as f:
        f.write(table_markdown(config_rows, threshold))
    write_csv(os.path.join(ablation_dir, "table.csv"), config_rows)
    write_csv(
        os.path.join(ablation_dir, "runs.csv"),
        [{**r, "run_dir": os.path.relpath(r["run_dir"], ablation_dir)} for r in run_rows],
    )
    return config_rows


def plot_band(
    ax,
    runs: dict[str, list[str]],
    key: str,
    *,
    window: int = 1,
    ylabel: str | None = None,
    include_rl_start: bool = False,
) -> None:
    """One line per config (mean over its seeds of metrics[key], smoothed over `window` points) with a ±1 std
    band, over RL steps: x = step - rl_start, so that seeds whose warm starts ended at different steps line up;
    include_rl_start keeps x = 0 (an evaluation at the end of the warm start). Configs that never logged `key`
    are left out."""
    for i, (name, run_dirs) in enumerate(runs.items()):
        curves = []
        for d in run_dirs:
            folder = RunFolder(d)
            rows = folder.read_metrics()
            steps, vals = series(rows, key)
            start = folder.rl_start(rows)
            keep = steps >= start if include_rl_start else steps > start
            steps, vals = steps[keep] - start, vals[keep]
            curves.append((steps, smooth(vals, window) if len(vals) else vals))
        steps, mean, std = seed_band(curves)
        if not len(steps):
            continue
        color = f"C{i % 10}"
        ax.plot(steps, mean, color=color, label=f"{name} (n={len(run_dirs)})", marker="o" if len(steps) < 30 else None)
        ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("RL step (0 = end of the IL warm start)")
    ax.set_ylabel(ylabel or key)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


# (file name, metrics key, y label, smoothing window, include the warm start's last step)
ABLATION_PLOTS = (
    ("eval_success.png", EVAL_SUCCESS, "held-out success", 1, True),
    ("train_reward.png", "reward_mean", "training reward (moving average of 5)", 5, False),
    ("admitted_fraction.png", "admitted_fraction", "admitted fraction (moving average of 5)", 5, False),
)


def write_plots(ablation_dir: str, runs: dict[str, list[str]]) -> list[str]:
    """The ABLATION_PLOTS as PNG files in `ablation_dir` (a bare Figure: no pyplot state, no display needed)."""
    from matplotlib.figure import Figure

    paths = []
    for filename, key, ylabel, window, include_rl_start in ABLATION_PLOTS:
        fig = Figure(figsize=(7, 4.5), dpi=100)
        ax = fig.add_subplot()
        plot_band(ax, runs, key, window=window, ylabel=ylabel, include_rl_start=include_rl_start)
        ax.set_title(ylabel.split(" (")[0] + " vs RL step (mean ± std over seeds)")
        fig.tight_layout()
        path = os.path.join(ablation_dir, filename)
        fig.savefig(path)
        paths.append(path)
    return paths
