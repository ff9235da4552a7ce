"""The longhorizon_flash preset on chains of 1-6 hops with a 600-step imitation cap, the warm start that works on
seeds 0-3."""

import dataclasses
from pathlib import Path

from ipa_jax.analysis.presets import load_preset


def get_preset():
    mixed = load_preset(Path(__file__).with_name("longhorizon_mixed.py"))
    return dataclasses.replace(
        load_preset(Path(__file__).with_name("longhorizon_flash.py")), description="", overrides=mixed.overrides
    )
