"""Seconds per weight sync to one dev server: through disk (float32, bfloat16 checkpoints) vs pushed over a gloo
group (SGLang's /update_weights_from_distributed), side by side in one run.

A random Qwen3 of --layers x --hidden (default 12 x 768, MLP 2048, vocabulary 16384: 101M parameters, printed)
lives in this process as the learner's model (float32); the dev server (`python -m ipa_jax.engines.devserver`, its
own process, the embedded engine in float32) starts on a float32 checkpoint of it. Each sync is one
SGLangEngine call from the model's parameters to the server serving them at a new version, the pause, the version
read-back and the continue included:

  disk_fp32    save_pretrained (float32) + update_weights (the server reads the safetensors)
  disk_bf16    save_pretrained (bfloat16) + update_weights
  distributed  update_weights_from_tensors over iter_hf_tensors (cast to bfloat16 and transposed by JAX, handed to
               torch through DLPack, in buckets of --bucket_mb; the group is made in the warm-up call and kept)

Each time is the median of --rounds interleaved rounds after a warm-up call of each (timing.py); the page cache
holds the checkpoints (the disk path's best case).

  python experiments/benchmarks/bench_weight_sync.py
  python experiments/benchmarks/bench_weight_sync.py --layers=24 --hidden=1024 --rounds=5
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from absl import app, flags
from timing import time_round_robin  # experiments/benchmarks/timing.py, beside this script

from ipa_jax.host_memory import keep_freed_host_memory

flags.DEFINE_integer("layers", 12, "decoder layers")
flags.DEFINE_integer("hidden", 768, "hidden size")
flags.DEFINE_integer("intermediate", 2048, "MLP width")
flags.DEFINE_integer("vocab", 16384, "vocabulary size (embedding and untied head)")
flags.DEFINE_integer("rounds", 3, "timed rounds")
flags.DEFINE_integer("bucket_mb", 512, "bucket size of the distributed sync (MiB, bfloat16)")
flags.DEFINE_string("out", "", "optional JSON file for the results")
FLAGS = flags.FLAGS


def start_dev_server(model_path: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ipa_jax.engines.devserver",
            "--model",
            model_path,
            "--port",
            str(port),
            "--max-len",
            "64",
            "--max-batch",
            "1",
            "--dist-timeout",
            "600",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError("dev server exited")
        try:
            urllib.request.urlopen(url + "/health", timeout=5).close()
            return proc, url
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise RuntimeError("dev server not up") from None
            time.sleep(0.5)


def main(_):
    import jax
    import ml_dtypes
    import numpy as np
    from flax import nnx

    from ipa_jax.engines import SGLangEngine
    from ipa_jax.engines.threads import LoopThread
    from ipa_jax.models import init_model, save_pretrained
    from ipa_jax.models.config import Qwen3Config
    from ipa_jax.models.hf_io import iter_hf_tensors

    heads = FLAGS.hidden // 64
    config = Qwen3Config(
        vocab_size=FLAGS.vocab,
        hidden_size=FLAGS.hidden,
        intermediate_size=FLAGS.intermediate,
        num_hidden_layers=FLAGS.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = init_model(config, seed=0)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"model: {FLAGS.layers} layers, hidden {FLAGS.hidden}, MLP {FLAGS.intermediate}, vocabulary {FLAGS.vocab}: "
        f"{params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB float32, {params * 2 / 2**20:.0f} MiB "
        f"bfloat16); jax {jax.__version__}, {os.cpu_count()} CPUs"
    )

    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        paths = {name: os.path.join(tmp, name) for name in ("base", "fp32", "bf16")}
        save_pretrained(model, paths["base"])
        proc, url = start_dev_server(paths["base"])
        loop = LoopThread("bench-weight-sync")
        engine = SGLangEngine([url], control_timeout_s=600.0, request_timeout_s=600.0)
        version = iter(range(1, 1_000_000))
        try:

            def disk(dtype, path):
                save_pretrained(model, path, dtype=dtype)
                loop.run(engine.update_weights(path, next(version)))

            def distributed():
                tensors = lambda: iter_hf_tensors(model, "bfloat16", on_host=False)  # noqa: E731
                loop.run(
                    engine.update_weights_from_tensors(tensors, next(version), bucket_bytes=FLAGS.bucket_mb * 2**20)
                )

            times = time_round_robin(
                {
                    "disk_fp32": lambda: disk(None, paths["fp32"]),
                    "disk_bf16": lambda: disk("bfloat16", paths["bf16"]),
                    "distributed": distributed,
                },
                FLAGS.rounds,
            )
            # the server holds the pushed weights: a check that the timed path moved them
            name, value = next(iter_hf_tensors(model))
            req = urllib.request.Request(
                url + "/get_weights_by_name",
                headers={"Content-Type": "application/json"},
                data=json.dumps({"name": name, "truncate_size": 4}).encode(),
            )
            with urllib.request.urlopen(req, timeout=600) as resp:
                served = np.array(json.loads(resp.read()))
            assert np.array_equal(served, value[:4].astype(ml_dtypes.bfloat16).astype(np.float32)), name
        finally:
            loop.run(engine.close())
            proc.terminate()
            proc.wait()

    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:12s} {med[k]:7.2f} s per sync (rounds: {', '.join(f'{t:.2f}' for t in v)})")
    print(
        f"distributed is {med['disk_fp32'] / med['distributed']:.2f}x faster than disk fp32 and "
        f"{med['disk_bf16'] / med['distributed']:.2f}x faster than disk bf16; "
        f"pushed {params * 2 / 2**20 / med['distributed']:.0f} MiB/s of bfloat16"
    )
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"parameters": params, "seconds": times, "median": med}, f, indent=2)


if __name__ == "__main__":
    keep_freed_host_memory()  # before JAX starts its CPU threads (ipa_jax/host_memory.py)
    app.run(main)
