"""How episodes become trajectories: the agent loop, rollout workers, the trajectory queue, dynamic sampling (and
resampling)."""

from ipa_jax.rollout.agent import AgentConfig, run_episode, run_episodes
from ipa_jax.rollout.dynamic_sampling import GroupSampler
from ipa_jax.rollout.queue import QueueClosed, TrajectoryQueue
from ipa_jax.rollout.workers import RolloutWorker

__all__ = [
    "AgentConfig",
    "GroupSampler",
    "QueueClosed",
    "RolloutWorker",
    "TrajectoryQueue",
    "run_episode",
    "run_episodes",
]
