"""Train a policy from a config file.

    python experiments/train.py --config=configs/quickstart.py [--config.objective.gamma=0.9]
    python experiments/train.py --config=configs/offline_tiny.py --config.train.data='("trajs.jsonl",)'
    python experiments/train.py --config=configs/quickstart.py --config_help     # every key, its value and help

Writes the run folder (runs/<train.name>/ unless train.run_dir is set; docs/run_folder.md); rerunning the same
command resumes from the latest complete checkpoint. Ctrl-C or SIGTERM (a scheduler's preemption) stops with a
checkpoint (after SIGTERM the exit status is 143); a run that cannot go on (rollout servers gone past
rollout.outage_budget_s, nothing admissible for queue.stall_timeout_s, train.max_consecutive_skipped updates in a row
skipped as non-finite) stops with a checkpoint, prints why and exits with status 1; a run folder another trainer holds
is refused on one line naming it (status 2). Multi-host: pass --coordinator_address/--num_processes/--process_id (or
the JAX_* environment variables, or nothing under srun / mpirun / a TPU slice on GKE: jax detects the cluster) and run
the same command on every host (experiments/launch.py renders the Slurm, GKE JobSet and Ray launchers).
"""

from absl import app, flags

from ipa_jax.host_memory import keep_freed_host_memory
from ipa_jax.pipeline import run
from ipa_jax.pipeline.cli import ConfigFlags, exit_on_config_error, exit_on_stop
from ipa_jax.train import distributed

CONFIG = ConfigFlags()
flags.DEFINE_string("coordinator_address", None, "jax.distributed coordinator host:port (multi-host).")
flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host).")
flags.DEFINE_integer("process_id", None, "This process's id (multi-host).")
FLAGS = flags.FLAGS


@exit_on_config_error
@exit_on_stop
def main(argv):
    del argv
    exp = CONFIG.experiment()
    distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    run(exp)


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main, flags_parser=CONFIG.parse)
