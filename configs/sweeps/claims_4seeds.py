"""The first headline table (docs/results.md, measured at 9b86c06): IPA (chunk credit) against imitation continued for
as many updates, token credit, and token credit with the early turns' weight matched; 4 seeds, shared warm starts,
each arm paired with credit_chunk. The claims preset supersedes it (one-change arms, 8 seeds, imperfect experts)."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=("credit_chunk", "control_il_continue", "credit_token", "credit_token_matched"),
        seeds=(0, 1, 2, 3),
        reference="credit_chunk",
        claim="lower",
    )
