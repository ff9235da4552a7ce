"""Reading runs and ablations: curves, per-run numbers, episode rendering, ablation sweeps, tables and plots.

    curves.py     metric series of one run, smoothing, AUC, steps to a threshold, the per-run table numbers
                  (RunResult: what a table reads of one run, from its folder or its results file)
    results.py    results files: per (config, seed) the table's numbers and per-task outcomes, committed-friendly
    stats.py      confidence intervals over seeds and held-out tasks, paired t-intervals, Holm, detectable
                  effects, sign tests, verdicts
    episodes.py   one episode as HTML (tokens coloured by chunk, context and expert targets)
    figures.py    one run's learning curve as a figure (held-out success, each phase's training signal)
    tables.py     ablation folders: manifest, comparison tables (Markdown, CSV) and plots
    sweep.py      train a set of configs over seeds (shared warm starts, interleaved arms, resumable) and write
                  the comparison; rebuild it from results files

The numbers in a table and the curves in a notebook come from the same code. Files are read through
`ipa_jax.pipeline.RunFolder`.
"""

from ipa_jax.analysis.curves import (
    COLLAPSE_FRACTION,
    EVAL_SUCCESS,
    RUN_CURVES,
    SCALARS,
    RunResult,
    curve_auc,
    final_outcomes,
    newest_run,
    run_scalars,
    runs_root,
    seed_band,
    series,
    smooth,
    steps_to_threshold,
)
from ipa_jax.analysis.episodes import Segment, episode_segments, load_run_tokenizer, render_episode_html
from ipa_jax.analysis.figures import run_figure
from ipa_jax.analysis.results import (
    config_sha,
    load_result,
    read_result,
    resolved_config,
    result_changes,
    result_path,
    results_of,
    write_result,
)
from ipa_jax.analysis.stats import (
    Estimate,
    PairedDifference,
    SignTest,
    TaskOutcomes,
    arm_estimate,
    hierarchical_bootstrap,
    holm,
    minimum_detectable_effect,
    paired_difference,
    paired_t,
    seeds_needed,
    sign_test,
    task_sampling_se,
    verdict,
)
from ipa_jax.analysis.tables import (
    ABLATION_PLOTS,
    ablation_reference,
    ablation_rows,
    comparison_columns,
    load_ablation,
    manifest_comparison,
    newest_ablation,
    plot_band,
    table_markdown,
    write_csv,
    write_plots,
    write_tables,
)

__all__ = [
    "ABLATION_PLOTS",
    "COLLAPSE_FRACTION",
    "EVAL_SUCCESS",
    "RUN_CURVES",
    "SCALARS",
    "RunResult",
    "result_changes",
    "config_sha",
    "load_result",
    "read_result",
    "resolved_config",
    "result_path",
    "results_of",
    "write_result",
    "Estimate",
    "PairedDifference",
    "Segment",
    "SignTest",
    "TaskOutcomes",
    "ablation_reference",
    "ablation_rows",
    "arm_estimate",
    "comparison_columns",
    "curve_auc",
    "episode_segments",
    "final_outcomes",
    "hierarchical_bootstrap",
    "holm",
    "load_ablation",
    "manifest_comparison",
    "load_run_tokenizer",
    "minimum_detectable_effect",
    "newest_ablation",
    "newest_run",
    "paired_difference",
    "paired_t",
    "plot_band",
    "render_episode_html",
    "run_figure",
    "run_scalars",
    "runs_root",
    "seed_band",
    "seeds_needed",
    "series",
    "sign_test",
    "smooth",
    "steps_to_threshold",
    "table_markdown",
    "task_sampling_se",
    "verdict",
    "write_csv",
    "write_plots",
    "write_tables",
]
