"""Ablation: DAPO's dynamic sampling on the GRPO arm (grpo.py: groups of 4 samples per task, group-mean baseline):
groups whose 4 rewards are all equal (every advantage 0) are dropped and replaced by further groups from the queue,
so each batch of 16 is 4 groups that carry a gradient; at most 4 batches' worth of groups are drawn per batch."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("grpo.py"))
    c.train.name = "grpo_dynamic_sampling"
    c.queue.dynamic_sampling = True
    c.rollout.schedule = "async"  # not lockstep: its batches take the groups the queue admits
    return c
