"""Branch credit in the jitted train step: the batch's per-chunk advantages reach the loss, microbatched as the full
batch, and a batch without branched trajectories trains on chunk credit."""

import dataclasses
import math

import jax
import numpy as np
from train_helpers import make_exp, synthetic_trajectories

from ipa_jax.models import MeshConfig, make_mesh
from ipa_jax.pipeline.build import build_state, build_steps
from ipa_jax.trajectory import pad_batch

BRANCH = ("objective.credit=branch", "train.batch_size=8")


def test_branch_advantages_reach_the_loss_and_microbatch_exactly():
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, expert=1, tensor=1), devices=jax.devices()[:1])
    full = make_exp(*BRANCH)
    state = build_state(full, mesh)
    step_full, _ = build_steps(full, state, mesh)
    step_micro, _ = build_steps(make_exp(*BRANCH, "train.microbatches=2"), state, mesh)
    trajs = synthetic_trajectories(8, seed=3)
    rng = np.random.default_rng(0)
    for traj in trajs[::2]:  # half of them branched, with advantages of both signs
        traj.chunk_advantages = rng.choice([-1.0, 0.5, 1.0], size=traj.num_chunks).astype(np.float32)
    branched = pad_batch(trajs, (32, 64))
    plain = pad_batch([dataclasses.replace(t, chunk_advantages=None) for t in trajs], (32, 64))
    assert plain.branch_advantages is None

    def rl_loss(step, batch):
        copy = jax.tree.map(lambda x: x.copy(), state)
        return float(step(copy, step.put_batch(batch))[1]["rl_loss"])

    with_branch, micro = rl_loss(step_full, branched), rl_loss(step_micro, branched)
    assert math.isclose(micro, with_branch, rel_tol=1e-5)
    assert not math.isclose(with_branch, rl_loss(step_full, plain), rel_tol=1e-3)  # the advantages changed it
    # Without branched trajectories the branch objective is chunk credit.
    chunk, _ = build_steps(make_exp("objective.credit=chunk", "train.batch_size=8"), state, mesh)
    assert math.isclose(rl_loss(step_full, plain), rl_loss(chunk, plain), rel_tol=1e-6)
