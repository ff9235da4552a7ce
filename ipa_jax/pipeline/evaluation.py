"""Held-out evaluation: the numbers reported for a set of finished episodes."""

from __future__ import annotations

import numpy as np

from ipa_jax.trajectory import Trajectory

EVAL_SEED = 0  # the held-out task set is the same for every run (comparable across seeds and configs)
SUCCESS_REWARD = 1.0  # an episode succeeds iff its reward reaches this


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Mean success (reward >= SUCCESS_REWARD), reward, tool calls, tool errors and turns over the episodes."""
    if not trajs:
        raise RuntimeError("evaluation: every episode was aborted by the engine")
    return {
        "success": float(np.mean([t.reward >= SUCCESS_REWARD for t in trajs])),
        "reward": float(np.mean([t.reward for t in trajs])),
        "tool_calls": float(np.mean([t.info["num_tool_calls"] for t in trajs])),
        "tool_errors": float(np.mean([t.info["num_tool_errors"] for t in trajs])),
        "turns": float(np.mean([t.info["num_turns"] for t in trajs])),
        "episodes": float(len(trajs)),
    }
