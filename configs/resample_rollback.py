"""Resampling comparison on the hard task: sequential rollback (anchor from the last chunk back to the start
once the tail is mastered), no IL fallback. See configs/resample_plain.py."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("resample_plain.py"))
    c.train.name = "resample_rollback"
    c.resample.mode = "rollback"
    c.resample.threshold = 0.5
    return c
