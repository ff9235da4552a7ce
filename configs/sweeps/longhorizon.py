"""The claims table on the long-horizon kv_chain task (seven chunks per success, failures of one to nine turns): IPA
against imitation continued, token credit and token credit with the first chunk's weight matched."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=(
            "longhorizon_credit_chunk",
            "longhorizon_control_il_continue",
            "longhorizon_credit_token",
            "longhorizon_credit_token_matched",
        ),
        seeds=(0, 1, 2, 3),
        claim="lower",
    )
