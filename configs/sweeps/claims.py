"""The README's headline table: IPA (chunk credit) against imitation continued for as many updates, token credit, and
token credit with the early turns' weight matched; 4 seeds, shared warm starts, each arm paired with credit_chunk."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=("credit_chunk", "control_il_continue", "credit_token", "credit_token_matched"),
        seeds=(0, 1, 2, 3),
        reference="credit_chunk",
        claim="lower",
    )
