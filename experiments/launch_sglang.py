"""Start SGLang servers for the rollout pool, wait until they generate, print their URLs.

    python experiments/launch_sglang.py --config=configs/X.py            # model.path + rollout.sglang_urls
    python experiments/launch_sglang.py --model_path=/ckpt --ports=30000,30001 [--routed_experts]
    python experiments/launch_sglang.py ... --dry_run                      # print the commands only

Keeps the servers in the foreground until Ctrl-C / SIGTERM (`ipa_jax.engines.sglang_launch`). With the environment
variable named by rollout.api_key_env (SGLANG_API_KEY by default) set, the servers require that key (SGLang's
--api-key), which the trainer's client sends; likewise rollout.admin_api_key_env (SGLANG_ADMIN_API_KEY) for
--admin-api-key, the key of the pause and weight-update routes. Needs the `sglang` extra and a CUDA GPU; without them
it exits with status 2 and says so (on a CPU machine use `python -m ipa_jax.engines.devserver`).
"""

import os
import sys

from absl import app, flags

from ipa_jax.engines.sglang_launch import (
    EXIT_MISSING_REQUIREMENTS,
    LaunchConfig,
    build_commands,
    missing_requirements,
    serve,
    shown,
)
from ipa_jax.pipeline.cli import ConfigFlags, exit_on_config_error
from ipa_jax.pipeline.config import RolloutConfig

CONFIG = ConfigFlags(
    "Experiment config file (configs/*.py), optional: model.path, rollout.sglang_urls.", required=False
)
flags.DEFINE_string("model_path", "", "HF model folder (default: config model.path).")
flags.DEFINE_string("host", "127.0.0.1", "Host to bind when --ports is given.")
flags.DEFINE_list("ports", [], "Server ports on --host (default: config rollout.sglang_urls, else 30000).")
flags.DEFINE_integer("weight_version", 0, "Initial --weight-version (the learner's policy version).")
flags.DEFINE_bool("routed_experts", None, "--enable-return-routed-experts (default: config model.routing_replay).")
flags.DEFINE_float("mem_fraction_static", 0.85, "Fraction of GPU memory for weights + KV cache.")
flags.DEFINE_integer("tp_size", 1, "Tensor-parallel GPUs per server.")
flags.DEFINE_string("dtype", "auto", "SGLang --dtype.")
flags.DEFINE_integer("context_length", 0, "SGLang --context-length (0: the model's).")
flags.DEFINE_bool("skip_tokenizer_init", False, "Token ids only (no stop strings, no text).")
flags.DEFINE_list("extra_args", [], "More launch_server arguments, comma-separated.")
flags.DEFINE_string("server_log_dir", "runs/sglang_logs", "Folder for per-server log files.")
flags.DEFINE_float("wait_timeout_s", 900.0, "Seconds to wait for /health_generate.")
flags.DEFINE_bool("dry_run", False, "Print the commands and exit (no sglang/CUDA needed).")
FLAGS = flags.FLAGS


def launch_config() -> LaunchConfig:
    """The flags over the experiment config (model.path, rollout.sglang_urls, model.routing_replay)."""
    exp = CONFIG.experiment() if CONFIG.path else None
    if FLAGS.ports:
        urls = tuple(f"http://{FLAGS.host}:{int(p)}" for p in FLAGS.ports)
    elif exp is not None and exp.rollout.sglang_urls:
        urls = exp.rollout.sglang_urls
    else:
        urls = (f"http://{FLAGS.host}:30000",)
    routed = FLAGS.routed_experts if FLAGS.routed_experts is not None else bool(exp and exp.model.routing_replay)
    rollout = exp.rollout if exp else RolloutConfig()
    return LaunchConfig(
        model_path=FLAGS.model_path or (exp.model.path if exp else ""),
        urls=urls,
        weight_version=FLAGS.weight_version,
        routed_experts=routed,
        mem_fraction_static=FLAGS.mem_fraction_static,
        tp_size=FLAGS.tp_size,
        dtype=FLAGS.dtype,
        context_length=FLAGS.context_length,
        skip_tokenizer_init=FLAGS.skip_tokenizer_init,
        extra_args=tuple(FLAGS.extra_args),
        api_key=os.environ.get(rollout.api_key_env, ""),
        admin_api_key=os.environ.get(rollout.admin_api_key_env, ""),
    )


@exit_on_config_error
def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cfg = launch_config()
    try:
        commands = build_commands(cfg)
    except ValueError as e:
        print(f"launch_sglang: {e}", file=sys.stderr)
        return 1
    if FLAGS.dry_run:
        print("\n".join(shown(cmd) for cmd in commands))
        return 0
    problem = missing_requirements()
    if problem is not None:
        print(problem, file=sys.stderr)
        return EXIT_MISSING_REQUIREMENTS
    return serve(cfg, commands, FLAGS.server_log_dir, FLAGS.wait_timeout_s)


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=CONFIG.parse)
