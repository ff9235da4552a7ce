"""Chunk-level initialized resampling: anchored rollouts from expert prefixes, crucial forks, sequential
rollback, parallel initialization and the imitation fallback.

Vocabulary. An expert trajectory has K tool-call chunks (assistant turns ending in tool calls, each with its
tool responses) and, usually, a final answer. Anchor j in [0, K] is the state after the expert's first j
chunks: the prompt, j expert turns and their observations. An anchored rollout prefills that state
(expert_mask 1, action_mask 0, the environment replayed through the expert's j calls, by
`agent.run_episode(prefill=...)`) and samples the tail with the policy. Anchor 0 is the plain start state.

A crucial fork is an anchor f whose success rate is far above the rate at anchor f-1 (by at least `fork_jump`):
expert chunk f-1 is the decision the policy has not mastered. A jump between sampled anchors further apart is a
span: one of the chunks between them decides. Fork mode resamples from the state just before the fork (and
bisects spans to find it); the imitation fallback imitates the expert's chunks at the jump.

Modules, each depending only on those listed before it:
  config     ResampleConfig: modes, anchors, rollback and imitation-fallback settings.
  experts    ExpertTrajectory: loading experts (scripted or JSONL) and replaying them as token rows.
  anchored   run_anchored / whole_expert_episode: episodes that start from an expert prefix.
  forks      ForkEstimate: success rate per anchor and the crucial forks; probe_forks samples them.
  resampler  Resampler: which anchors to sample, outcomes, rollback, imitation targets, checkpoint state
             (pure Python, no engine).
  source     resample_round / ResampleSource: the asynchronous sampling with any Engine.
"""

from ipa_jax.rollout.resample.anchored import run_anchored, whole_expert_episode
from ipa_jax.rollout.resample.config import MODES, WEIGHTINGS, ResampleConfig
from ipa_jax.rollout.resample.experts import (
    ExpertReplay,
    ExpertTrajectory,
    build_experts,
    expert_from_messages,
    expert_from_trajectory,
    load_experts,
    replay_expert,
)
from ipa_jax.rollout.resample.forks import ForkEstimate, estimate_forks, forks_by_anchor, probe_forks
from ipa_jax.rollout.resample.resampler import Planned, Resampler
from ipa_jax.rollout.resample.source import ResampleSource, resample_round

__all__ = [
    "MODES",
    "WEIGHTINGS",
    "ResampleConfig",
    "ExpertReplay",
    "ExpertTrajectory",
    "build_experts",
    "expert_from_messages",
    "expert_from_trajectory",
    "load_experts",
    "replay_expert",
    "run_anchored",
    "whole_expert_episode",
    "ForkEstimate",
    "estimate_forks",
    "forks_by_anchor",
    "probe_forks",
    "Planned",
    "Resampler",
    "ResampleSource",
    "resample_round",
]
