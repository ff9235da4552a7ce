"""The longhorizon preset on chains of 1-6 hops with a 600-step imitation cap, the warm start that works on seeds
0-3 (fixed six hops leave seeds 2 and 3 at 0% held-out success)."""

import dataclasses
from pathlib import Path

from ipa_jax.analysis.presets import load_preset

# kv_chain with each chain drawn from 1-6 hops (the expert's episodes too) and a 600-step imitation cap.
MIXED_HOPS = (("env.kwargs.min_hops", 1), ("train.il_warmup_steps", 600), ("train.steps", 680))


def get_preset():
    return dataclasses.replace(
        load_preset(Path(__file__).with_name("longhorizon.py")), description="", overrides=MIXED_HOPS
    )
