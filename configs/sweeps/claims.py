"""IPA's claims against one-change arms, each with a verdict: IPA (credit_chunk) against imitation continued with
IPA's learning rate and aggregation (its data the one difference) and filtered imitation; token credit beside its
matched-discount arm, without a baseline and with a batch-mean one subtracted after discounting (failures carrying
negative credit, and a success's early units below the baseline: the credit_*_baseline arms test the credit
assignment itself, credit_negative_share_success their manipulation check); the hybrid IL term
(il_term_on against il_term_off); with an A/A rerun and two positive controls. Three comparisons are the
pre-registered claims (Holm's family): IPA against imitation continued, chunk against token credit with a baseline,
and the IL term; the other arms are descriptive. 8 seeds x 512 held-out tasks, on the calculator with 2 and 3
operations, the expert perfect and wrong on half the tasks (4 conditions, a table each); warm starts to the imitation
plateau (train.il_warmup_patience, at most 600 steps), then 80 RL steps, one warm start shared by every arm of a
seed."""

from ipa_jax.analysis.presets import Preset

# The imitation plateau: no rise of the greedy match's 10-batch mean for 40 steps, at most 600 imitation steps.
PLATEAU = (
    ("train.il_warmup_target", 0.0),
    ("train.il_warmup_patience", 40),
    ("train.il_warmup_steps", 600),
    ("train.steps", 680),
    ("train.eval_episodes", 512),
)
CONDITIONS = tuple(
    (f"ops{ops}_error{round(100 * error)}", (("env.kwargs.ops", ops), ("env.expert_error", error)))
    for ops in (2, 3)
    for error in (0.0, 0.5)
)


def get_preset():
    return Preset(
        configs=(
            "credit_chunk",
            "control_il_continue_matched",
            "control_il_filtered",
            "credit_token",
            "credit_token_matched",
            "credit_chunk_baseline",
            "credit_token_baseline",
            "credit_token_matched_baseline",
            "il_term_on",
            "il_term_off",
            "control_aa",
            "control_advantage_flip",
            "control_reward_flip",
        ),
        seeds=tuple(range(8)),
        reference="credit_chunk",
        claim="lower",  # IPA's choice (each row's reference) beats the alternative
        pairs=(
            ("credit_token_baseline", "credit_chunk_baseline"),
            ("credit_token_matched_baseline", "credit_chunk_baseline"),
            ("il_term_off", "il_term_on"),
        ),
        # The pre-registered claims (the Holm family), each against its reference: IPA beats imitation on the same
        # data budget (control_il_continue_matched vs credit_chunk), chunk credit beats token credit with a baseline
        # (credit_token_baseline vs credit_chunk_baseline), the hybrid IL term helps (il_term_off vs il_term_on).
        # The other arms are descriptive; control_aa must hold 0, the flips must be detected.
        claims=("control_il_continue_matched", "credit_token_baseline", "il_term_off"),
        aa_controls=("control_aa",),
        controls=("control_advantage_flip", "control_reward_flip"),
        overrides=PLATEAU,
        conditions=CONDITIONS,
    )
