"""One process of the multi-host online tests: `python online_worker.py RUN_DIR TOKENIZER_DIR NUM_PROCESSES
PROCESS_ID PORT [OVERRIDES_JSON]`.

Runs `ipa_jax.pipeline.run` on the tiny online setting (tiny_pipeline.py) made reproducible: one IL warm-start step,
then synchronous resampling rounds (the learner waits for each) played one episode at a time, so that the engine sees
the same requests in the same order whatever the process layout; the engines sit on 4 local devices of process 0 in
every layout (the same computation, hence the same samples). The untrained policy fails every task: the whole expert
episodes the fallback adds for its failures make every step an update. The caller's XLA_FLAGS set the local CPU
devices (8 // NUM_PROCESSES)."""

import json
import os
import sys

run_dir, tokenizer_dir, num_processes, process_id, port = sys.argv[1:6]
overrides = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
from tiny_pipeline import tiny_config  # noqa: E402

from ipa_jax.pipeline import run  # noqa: E402
from ipa_jax.train import distributed  # noqa: E402

distributed.initialize(f"localhost:{port}", int(num_processes), int(process_id))
assert jax.device_count() == 8 and jax.process_count() == int(num_processes)
REPRODUCIBLE = {
    "model.tokenizer": tokenizer_dir,
    "train.steps": 3,
    "train.il_warmup_steps": 1,
    "train.eval_episodes": 2,
    "resample.mode": "none",
    "resample.tasks_per_round": 2,
    "resample.samples_per_anchor": 3,
    "resample.num_tasks": 4,
    # A task whose 3 samples all fail gets its whole expert episode: with the imitation term, every step updates.
    "resample.il_fallback": True,
    "resample.il_whole_episode": True,
    "objective.il_weight": 0.5,
    "rollout.concurrency": 1,
    "rollout.engine_devices": 4,
}
run(tiny_config(run_dir, **{**REPRODUCIBLE, **overrides}))
