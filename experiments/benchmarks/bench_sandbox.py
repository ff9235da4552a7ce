"""Sandbox cost: bubblewrap next to plain `subprocess`, the same commands, in one run.

Start latency: a fresh sandbox (workspace folder with a few files) and its first command (`true`), against a
fresh temporary folder and `bash -c true` there. Throughput: commands per second with 1, 4 and 16 commands in
flight (threads, as the agent loop runs them), each command drawn from a small mix (echo, ls, a pipeline,
python3 -c), every command in its own sandbox invocation over a per-worker workspace. Each measurement is the
best of --rounds interleaved rounds (bubblewrap and plain alternate, so background load hits both alike).

  python experiments/benchmarks/bench_sandbox.py
  python experiments/benchmarks/bench_sandbox.py --commands=400 --rounds=5 --out=sandbox.json
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time

from absl import app, flags

from ipa_jax.envs.sandbox import BubblewrapBackend
from ipa_jax.envs.sandbox.bubblewrap import SANDBOX_PATH

flags.DEFINE_list("concurrency", ["1", "4", "16"], "commands in flight")
flags.DEFINE_integer("commands", 200, "commands per throughput measurement")
flags.DEFINE_integer("starts", 50, "sandboxes created per start-latency measurement")
flags.DEFINE_integer("rounds", 3, "interleaved rounds; the best is reported")
flags.DEFINE_string("out", "", "optional JSON file for the results")
FLAGS = flags.FLAGS

COMMANDS = ("echo hello", "ls -la", "cat notes.txt | tr a-z A-Z | wc -c", "python3 -c 'print(6 * 7)'")
FILES = {"notes.txt": "some text\n", "data/values.csv": "a,b\n1,2\n"}


class Plain:
    """The baseline: `bash -c` in a temporary folder, no isolation."""

    def create(self):
        folder = tempfile.mkdtemp(prefix="bench_plain_")
        for rel, text in FILES.items():
            os.makedirs(os.path.dirname(os.path.join(folder, rel)), exist_ok=True)
            with open(os.path.join(folder, rel), "w") as f:
                f.write(text)
        return folder

    def run(self, folder, command):
        # The sandbox's PATH and a clean environment: the same programs run on both sides.
        return subprocess.run(
            ["bash", "-c", command],
            cwd=folder,
            capture_output=True,
            timeout=30,
            env={"PATH": SANDBOX_PATH, "HOME": folder},
        ).returncode

    def close(self, folder):
        shutil.rmtree(folder)


class Bubblewrap:
    def __init__(self):
        self.backend = BubblewrapBackend()

    def create(self):
        return self.backend.create(FILES)

    def run(self, box, command):
        return box.run(command).exit_code

    def close(self, box):
        box.close()


def start_latency(kind, n: int) -> float:
    """Seconds per (create a workspace + run `true` + delete it)."""
    t0 = time.perf_counter()
    for _ in range(n):
        box = kind.create()
        assert kind.run(box, "true") == 0
        kind.close(box)
    return (time.perf_counter() - t0) / n


def throughput(kind, concurrency: int, n: int) -> float:
    """Commands per second with `concurrency` commands in flight."""
    boxes = [kind.create() for _ in range(concurrency)]
    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            t0 = time.perf_counter()
            codes = list(pool.map(lambda i: kind.run(boxes[i % concurrency], COMMANDS[i % len(COMMANDS)]), range(n)))
            elapsed = time.perf_counter() - t0
    finally:
        for box in boxes:
            kind.close(box)
    assert codes == [0] * n, "a benchmark command failed"
    return n / elapsed


def main(_):
    kinds = {"bubblewrap": Bubblewrap(), "plain": Plain()}
    start = {k: float("inf") for k in kinds}
    rate = {(k, int(c)): 0.0 for k in kinds for c in FLAGS.concurrency}
    for _ in range(FLAGS.rounds):
        for name, kind in kinds.items():
            start[name] = min(start[name], start_latency(kind, FLAGS.starts))
            for c in FLAGS.concurrency:
                rate[name, int(c)] = max(rate[name, int(c)], throughput(kind, int(c), FLAGS.commands))
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"best of {FLAGS.rounds} interleaved rounds"
    )
    print(f"{'':28s} {'bubblewrap':>12s} {'plain':>12s} {'cost':>8s}  (cost: bubblewrap time / plain time)")
    print(
        f"{'start + first command (ms)':28s} {start['bubblewrap'] * 1e3:12.1f} {start['plain'] * 1e3:12.1f} "
        f"{start['bubblewrap'] / start['plain']:7.2f}x"
    )
    for c in FLAGS.concurrency:
        b, p = rate["bubblewrap", int(c)], rate["plain", int(c)]
        print(f"{f'commands/s, {c} in flight':28s} {b:12.1f} {p:12.1f} {p / b:7.2f}x")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"start_s": start, "commands_per_s": {f"{k}@{c}": v for (k, c), v in rate.items()}}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
