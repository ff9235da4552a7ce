"""Policy lag 0 / 4 x mismatch correction on / off x old log-probs behaviour / recompute, with negatives (batch-mean
baseline), shared warm starts."""

from ipa_jax.analysis.presets import Preset


def get_preset():
    return Preset(
        configs=(
            "offpolicy_lag0",
            "offpolicy_lag0_nomismatch",
            "offpolicy_lag0_recompute",
            "offpolicy_lag0_recompute_nomismatch",
            "offpolicy_lag4",
            "offpolicy_lag4_nomismatch",
            "offpolicy_lag4_recompute",
            "offpolicy_lag4_recompute_nomismatch",
        ),
        seeds=(0, 1, 2),
    )
