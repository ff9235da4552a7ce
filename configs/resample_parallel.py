"""Resampling comparison on the hard task: parallel initialization (anchors at the start, the middle and the
last chunk; the budget weighted towards anchors with mixed outcomes), no IL fallback. See configs/resample_plain.py."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("resample_plain.py"))
    c.train.name = "resample_parallel"
    c.resample.mode = "parallel"
    c.resample.anchors = (0.0, 0.5, 1.0)
    c.resample.weighting = "variance"
    return c
