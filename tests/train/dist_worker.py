"""One process of the multi-host test: `python dist_worker.py OUT NUM_PROCESSES PROCESS_ID PORT`.

Runs two train steps of the tiny model on a fixed global batch over a data-parallel mesh of all global devices
(8 // NUM_PROCESSES local CPU devices per process: the caller's XLA_FLAGS set them), each process feeding only its
rows; process 0 writes the gathered parameters and losses to OUT (.npz)."""

import os
import sys

out, num_processes, process_id, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from train_helpers import make_batch, make_exp  # noqa: E402

from ipa_jax.pipeline.build import build_mesh, build_state, build_steps  # noqa: E402
from ipa_jax.train import distributed  # noqa: E402

distributed.initialize(f"localhost:{port}", num_processes, process_id)
assert jax.device_count() == 8 and jax.process_count() == num_processes
exp = make_exp("train.batch_size=8", "mesh.data=-1", "objective.il_weight=0.5", "model.arch.num_hidden_layers=1")
mesh = build_mesh(exp.mesh)
state = build_state(exp, mesh)
step, _ = build_steps(exp, state, mesh)
batch = make_batch(8, seed=5)  # the global batch: every process builds it, each uploads its own rows
losses = []
for _ in range(2):
    state, metrics = step(state, step.put_batch(batch))
    losses.append(float(metrics["loss"]))
params = multihost_utils.process_allgather(state.params, tiled=True)
if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(params)}
    np.savez(out, losses=np.asarray(losses), **flat)
