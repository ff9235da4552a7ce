"""One trainer per run folder: a second one is refused on one line naming the holder; a crashed holder's lock is
taken over; without flock, the recorded holder is the lock (taken over only when it is known to be gone)."""

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
from cpu_env import xla_flags
from tiny_pipeline import offline_rows

from ipa_jax.pipeline import RunFolder, load_config, run
from ipa_jax.pipeline import run_lock as run_lock_module
from ipa_jax.pipeline.run_lock import LOCK_FILE, RunFolderBusy, run_folder_lock
from ipa_jax.trajectory import write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "offline_tiny.py")
# One process of a 2-process run: tries a held folder, then a free one. argv: held, free, process id, port.
MULTI_HOST = (
    "import sys\nfrom ipa_jax.train import distributed\n"
    "distributed.initialize(f'localhost:{sys.argv[4]}', 2, int(sys.argv[3]))\n"
    "from ipa_jax.pipeline.run_lock import RunFolderBusy, run_folder_lock\n"
    "for run_dir in sys.argv[1:3]:\n    try:\n        with run_folder_lock(run_dir):\n"
    "            print('held', flush=True)\n    except RunFolderBusy as e:\n"
    "        print(f'busy: {e}', flush=True)\n"
)
HOLD = (
    "import sys, time\nfrom ipa_jax.pipeline.run_lock import run_folder_lock\n"
    "with run_folder_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)\n"
)


def holder_pattern(pid: int) -> str:
    return rf"pid {pid} on host {re.escape(socket.gethostname())}, started \d{{4}}-\d\d-\d\dT"


def test_a_held_folder_is_refused_naming_the_holder_and_free_after_release(tmp_path, caplog):
    run_dir = tmp_path / "run"
    with run_folder_lock(run_dir):
        with pytest.raises(RunFolderBusy, match=holder_pattern(os.getpid())) as busy:
            with run_folder_lock(run_dir):
                pass
        assert busy.value.key == "train.run_dir" and "\n" not in str(busy.value)
    with caplog.at_level(logging.WARNING), run_folder_lock(run_dir):  # a clean release leaves nothing to take over
        pass
    assert "taking over" not in caplog.text
    assert os.path.getsize(run_dir / LOCK_FILE) == 0


def test_a_second_trainer_exits_on_one_line_and_a_killed_holders_lock_is_taken_over(tmp_path, caplog):
    data, run_dir = tmp_path / "data.jsonl", tmp_path / "run"
    write_jsonl(data, offline_rows(16))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(1),
        "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    }
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        second = subprocess.run(
            [
                sys.executable,
                os.path.join(REPO, "experiments", "train.py"),
                f"--config={TINY}",
                f"--config.train.data=('{data}',)",
                f"--config.train.run_dir={run_dir}",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert second.returncode == 2, second.stderr[-3000:]
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: config key 'train.run_dir': {run_dir} is in use by another trainer (")
    assert re.search(holder_pattern(holder.pid), line) and "Traceback" not in second.stderr
    assert not os.path.exists(run_dir / "config.json")  # refused before writing anything

    with caplog.at_level(logging.WARNING):
        summary = run(
            load_config(
                TINY,
                {
                    "train.data": (str(data),),
                    "train.run_dir": str(run_dir),
                    "train.steps": 2,
                    "train.batch_size": 8,
                    "logging.tensorboard": False,
                },
            )
        )
    assert summary["steps"] == 2 and RunFolder(run_dir).has_summary()
    assert re.search(
        "taking over the lock of a trainer that ended without releasing it \\(" + holder_pattern(holder.pid),
        caplog.text,
    )


@pytest.mark.slow
def test_multi_host_process_0_holds_the_lock_and_every_process_learns_whether_it_got_it(tmp_path):
    held, free = tmp_path / "held", tmp_path / "free"
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = str(sock.getsockname()[1])
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": xla_flags(1),
        "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    }
    with run_folder_lock(held):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", MULTI_HOST, str(held), str(free), str(i), port],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outputs]
    (first, then0), (other, then1) = (
        [line for line in out.splitlines() if line.startswith(("busy", "held"))] for out, _ in outputs
    )  # gloo prints a line of its own
    assert re.fullmatch(r"busy: .*" + holder_pattern(os.getpid()) + r".*", first)
    assert (
        other == f"busy: config key 'train.run_dir': {held} is in use by another trainer (process 0 could not "
        "lock it: see its error): wait for it to end, stop it, or choose another train.run_dir"
    )
    assert then0 == then1 == "held"
    assert os.path.exists(free / LOCK_FILE)


def test_without_flock_the_recorded_holder_is_the_lock(tmp_path, monkeypatch, caplog):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock_module.fcntl, "flock", no_flock)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ended = subprocess.Popen(["true"])
    ended.wait()
    for pid, host in ((ended.pid, "elsewhere"), (os.getpid(), socket.gethostname())):
        (run_dir / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host, "started": "2026-01-01T00:00:00"}))
        with pytest.raises(RunFolderBusy, match=f"pid {pid} on host {host}, started 2026-01-01T00:00:00"):
            with run_folder_lock(run_dir):
                pass
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": ended.pid, "host": socket.gethostname(), "started": "x"}))
    with caplog.at_level(logging.WARNING), run_folder_lock(run_dir):  # a process of this host that has ended
        assert f"taking over the lock of a trainer that ended without releasing it (pid {ended.pid}" in caplog.text
        with pytest.raises(RunFolderBusy, match=holder_pattern(os.getpid())):
            with run_folder_lock(run_dir):
                pass
    with run_folder_lock(run_dir):  # released
        pass


def test_an_object_store_folder_has_no_lock_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # a URI taken for a local path would show up here as ./gs:/...
    with caplog.at_level(logging.WARNING), run_folder_lock("gs://bucket/run"):
        pass
    assert "object store, which has no lock" in caplog.text
    assert os.listdir(tmp_path) == []
