"""The ablation machinery end to end in minutes, not a measurement: chunk against token credit, 2 seeds, a 40-step
warm start shared by both arms, 10 lockstep RL steps, 32 held-out tasks; a table with its intervals and verdicts,
and the plots, in runs/ablations/smoke/. Its numbers say nothing about the arms (too short, too few tasks), so it
writes no results files."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=("credit_chunk", "credit_token"),
        seeds=(0, 1),
        claim="lower",
        overrides=(
            ("train.il_warmup_target", 0.0),  # a fixed-length warm start
            ("train.il_warmup_steps", 40),
            ("train.steps", 50),
            ("train.eval_episodes", 32),
        ),
        keep_results=False,
    )
