"""FlashREINFORCE's aggregation claim where it can show: sample-mean against token-mean on kv_chain, whose failures
vary several-fold in length."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=("longhorizon_flash_reinforce", "longhorizon_flash_token_mean"), seeds=(0, 1, 2, 3), claim="lower"
    )
