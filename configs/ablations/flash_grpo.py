"""Ablation (FlashREINFORCE, baseline): flash_reinforce.py with GRPO-style groups in place of one rollout per prompt:
4 samples per task (the same batch of 16 trajectories = 4 tasks x 4), A_i = R_i - mean of its group's rewards
instead of the batch mean. FlashREINFORCE's claim: one rollout per prompt with batch-centred rewards is enough."""

from pathlib import Path

from ipa_jax.pipeline import load_config


def get_config():
    c = load_config(Path(__file__).with_name("flash_reinforce.py"))
    c.train.name = "flash_grpo"
    c.rollout.group_size = 4
    c.objective.baseline = "group_mean"
    return c
