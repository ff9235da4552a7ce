"""The flash and flash_staleness arms at an RL learning rate of 4e-4, where the policy can collapse: which parts keep
it from collapsing."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=(
            "flash_reinforce",
            "flash_tr_off",
            "flash_token_mean",
            "flash_entropy_q05",
            "flash_lag4",
            "flash_lag4_tr_off",
        ),
        seeds=(0, 1),
        overrides=(("optimizer.lr", 0.0004),),
        claim="lower",
    )
