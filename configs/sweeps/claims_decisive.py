"""IPA's central claims decided in one condition: the calculator with 3 operations, the expert wrong on half the tasks
(so RL has something to add to imitation), 8 seeds, 512 held-out tasks, lockstep rollouts (common random numbers:
every arm of a seed starts RL from one warm start, on the same tasks with the same episode keys). The claims: IPA
beats imitation continued with IPA's settings (control_il_continue_matched against credit_chunk); chunk credit
beats token credit with a batch-mean baseline subtracted after discounting (credit_token_baseline against
credit_chunk_baseline; the matched-discount arm beside it); the hybrid IL term helps (il_term_off against
il_term_on). Beside them: token credit without a baseline, also with other episode keys than credit_chunk's (what
common random numbers save: docs/statistics.md), an A/A rerun with other episode keys and a positive control (the
advantage's sign flipped). Warm starts to the imitation plateau (at most 600 steps), then 80 RL steps."""

from ipa_jax.analysis.presets import Preset

SETTINGS = (
    ("train.il_warmup_target", 0.0),
    ("train.il_warmup_patience", 40),
    ("train.il_warmup_steps", 600),
    ("train.steps", 680),
    ("train.eval_episodes", 512),
    ("train.eval_every", 0),  # held-out success after the warm start and at the end: what the table reads
)


def get_preset():
    return Preset(
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
        seeds=tuple(range(8)),
        reference="credit_chunk",
        claim="lower",  # IPA's choice (each row's reference) beats the alternative
        pairs=(
            ("credit_token_baseline", "credit_chunk_baseline"),
            ("credit_token_matched_baseline", "credit_chunk_baseline"),
            ("il_term_off", "il_term_on"),
        ),
        claims=("control_il_continue_matched", "credit_token_baseline", "il_term_off"),  # the Holm family
        controls=("control_advantage_flip",),
        aa_controls=("control_aa",),
        overrides=SETTINGS,
        conditions=(("ops3_error50", (("env.kwargs.ops", 3), ("env.expert_error", 0.5))),),
    )
