"""Resampling comparison on the hard task: sequential rollback (anchor from the last chunk back to the start
once the tail is mastered), no IL fallback. See configs/resample_plain.py."""

from configs.resample_plain import get_config as plain_config


def get_config():
    c = plain_config()
    c.train.name = "resample_rollback"
    c.resample.mode = "rollback"
    c.resample.threshold = 0.5
    return c
