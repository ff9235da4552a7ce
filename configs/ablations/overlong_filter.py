"""Ablation: DAPO's overlong filtering on the common base: episodes cut off by their token budget (finish reason
length or context) leave the loss (objective.overlong_filter)."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("common.py"))
    c.train.name = "overlong_filter"
    c.objective.overlong_filter = True
    return c
