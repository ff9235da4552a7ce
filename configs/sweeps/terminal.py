"""IPA against imitation continued and token credit on the terminal suite's easy tier (shell commands in sandboxes);
for a policy that learns the tier: the tiny CPU policy stays at ~6% (configs/ablations/terminal_common.py)."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=("terminal_credit_chunk", "terminal_control_il_continue", "terminal_credit_token"),
        seeds=(0, 1, 2, 3),
        claim="lower",
    )
