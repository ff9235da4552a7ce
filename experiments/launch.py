"""Render a launcher for a training config: a Slurm sbatch script, a GKE JobSet manifest or a Ray job script
(docs/launch.md). Every process runs `python experiments/train.py --config=CONFIG [--config.KEY=VALUE ...]`.

    python experiments/launch.py --config=configs/quickstart.py --target=slurm --nodes=4 --accelerators_per_node=8 \
        --accelerator=h100 --processes_per_node=8 --partition=gpu
    python experiments/launch.py --config=configs/quickstart.py --target=gke --nodes=4 --image=IMAGE \
        --accelerator=tpu-v5p-slice --accelerators_per_node=4 --tpu_topology=2x2x4 \
        --config.train.run_dir=gs://BUCKET/runs/quickstart
    python experiments/launch.py --config=configs/quickstart.py --target=slurm --nodes=2 --dry_run \
        --config.train.steps=2 ...                  # also run the 2 processes here, on CPU (docs/launch.md)

The config is loaded and validated here first. Writes the launcher to --out (default runs/launch/<name><suffix>),
prints it and
the command that submits it; nothing is submitted. --dry_run then runs the launcher's processes on this machine
with the environment its cluster would give them (JAX_PLATFORMS=cpu, gloo) and exits with the worst status.
"""

import os
import sys

from absl import app, flags

from ipa_jax.launch import TARGETS, LaunchSpec, job_name, run_local
from ipa_jax.pipeline.cli import ConfigFlags, exit_on_config_error

CONFIG = ConfigFlags("Training config file, as every process of the job reads it (a path relative to --workdir).")
flags.DEFINE_enum("target", None, sorted(TARGETS), "The launcher to render.", required=True)
flags.DEFINE_string("name", None, "Job name (default: the config's train.name, made a valid name).")
flags.DEFINE_integer("nodes", 1, "Hosts.")
flags.DEFINE_integer("processes_per_node", 1, "Slurm: tasks per node (one per GPU is jax's convention).")
flags.DEFINE_string(
    "accelerator",
    "",
    "Empty: CPU. GPUs: 'gpu' or a type (Slurm: h100; GKE: nvidia-h100-80gb). TPUs (GKE): the TPU type (tpu-v5p-slice).",
)
flags.DEFINE_integer("accelerators_per_node", 0, "GPUs or TPU chips per node.")
flags.DEFINE_string("tpu_topology", "", "GKE TPU slice topology (e.g. 2x2x4).")
flags.DEFINE_string("workdir", ".", "The repository root on the nodes (GKE: default the image's working directory).")
flags.DEFINE_string("python", "python", "The Python interpreter on the nodes.")
flags.DEFINE_multi_string("env", [], "KEY=VALUE environment variable of every process (repeatable).")
flags.DEFINE_integer("coordinator_port", 8476, "jax's coordinator port (GKE, Ray).")
flags.DEFINE_string("partition", "", "Slurm partition.")
flags.DEFINE_string("account", "", "Slurm account.")
flags.DEFINE_string("time", "24:00:00", "Slurm time limit.")
flags.DEFINE_string("image", "", "GKE container image holding the repository and its environment.")
flags.DEFINE_integer("max_restarts", 0, "GKE: JobSet restarts after a failure (each resumes from the checkpoint).")
flags.DEFINE_string("out", None, "Where to write the launcher (default runs/launch/<name><suffix>).")
flags.DEFINE_bool("dry_run", False, "Also run the job's processes on this machine (CPU, gloo).")
flags.DEFINE_string("dry_run_logs", None, "Folder of the dry run's per-process logs (default runs/launch/<name>_logs).")
flags.DEFINE_float("dry_run_timeout_s", 600.0, "Stop the dry run's processes after this long.")
FLAGS = flags.FLAGS
LAUNCH_DIR = os.path.join("runs", "launch")  # with every other output, under the ignored runs/


@exit_on_config_error
def main(argv):
    del argv
    exp = CONFIG.experiment()
    env = dict(item.split("=", 1) for item in FLAGS.env if "=" in item)
    if len(env) != len(FLAGS.env):
        raise app.UsageError(f"--env takes KEY=VALUE, got {FLAGS.env}")
    spec = LaunchSpec(
        config=CONFIG.path,
        name=FLAGS.name or job_name(exp.train.name),
        nodes=FLAGS.nodes,
        overrides=tuple(CONFIG.overrides),
        processes_per_node=FLAGS.processes_per_node,
        accelerator=FLAGS.accelerator,
        accelerators_per_node=FLAGS.accelerators_per_node,
        tpu_topology=FLAGS.tpu_topology,
        workdir=FLAGS.workdir,
        python=FLAGS.python,
        env=env,
        coordinator_port=FLAGS.coordinator_port,
        partition=FLAGS.partition,
        account=FLAGS.account,
        time=FLAGS.time,
        image=FLAGS.image,
        max_restarts=FLAGS.max_restarts,
    )
    target = TARGETS[FLAGS.target]
    text = target.render(spec)
    out = FLAGS.out or os.path.join(LAUNCH_DIR, spec.name + target.suffix)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(text, end="")
    print(f"# wrote {out}; submit with: {target.submit.format(path=out)}", flush=True)
    if FLAGS.dry_run:
        logs = FLAGS.dry_run_logs or os.path.join(LAUNCH_DIR, spec.name + "_logs")
        results = run_local(spec, FLAGS.target, logs, FLAGS.dry_run_timeout_s)
        for r in results:
            print(f"# dry run: process {r.process_id} of {len(results)} exited with {r.returncode} (log: {r.log_path})")
        sys.exit(max(abs(r.returncode) for r in results))


if __name__ == "__main__":
    app.run(main, flags_parser=CONFIG.parse)
