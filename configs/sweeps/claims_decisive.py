"""IPA's central claims decided in one condition: the calculator with 3 operations, the expert wrong on half the tasks
(so RL has something to add to imitation), 8 seeds, 512 held-out tasks, lockstep rollouts (common random numbers:
every arm of a seed starts RL from one warm start, on the same tasks with the same episode keys). The claims of
claims.py: IPA beats imitation continued with IPA's settings (control_il_continue_matched against credit_chunk);
chunk credit beats token credit with a batch-mean baseline subtracted after discounting (credit_token_baseline
against credit_chunk_baseline; the matched-discount arm beside it); the hybrid IL term helps (il_term_off against
il_term_on). Beside them: token credit without a baseline, also with other episode keys than credit_chunk's (what
common random numbers save: docs/statistics.md), an A/A rerun with other episode keys and a positive control (the
advantage's sign flipped). Warm starts to the imitation plateau (at most 600 steps), then 80 RL steps."""

import dataclasses
from pathlib import Path

from ipa_jax.analysis.presets import load_preset

SETTINGS = (
    ("train.il_warmup_target", 0.0),
    ("train.il_warmup_patience", 40),
    ("train.il_warmup_steps", 600),
    ("train.steps", 680),
    ("train.eval_episodes", 512),
    ("train.eval_every", 0),  # held-out success after the warm start and at the end: what the table reads
)


def get_preset():
    claims = load_preset(Path(__file__).with_name("claims.py"))
    return dataclasses.replace(
        claims,
        configs=(
            "credit_chunk",
            "control_il_continue_matched",
            "credit_chunk_baseline",
            "credit_token_baseline",
            "credit_token_matched_baseline",
            "il_term_on",
            "il_term_off",
            "credit_token",
            "credit_token_other_keys",
            "control_aa",
            "control_advantage_flip",
        ),
        description="",  # this file's docstring
        controls=("control_advantage_flip",),
        overrides=SETTINGS,
        conditions=(("ops3_error50", (("env.kwargs.ops", 3), ("env.expert_error", 0.5))),),
    )
