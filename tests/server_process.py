"""Servers in their own processes for the tests: the fake dev server (tests/engines/fake_devserver.py, the
`fake_server` fixture) and the real one on a checkpoint (`python -m ipa_jax.engines.devserver`), to SIGKILL, SIGSTOP
and restart on their port."""

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started as `argv` + --port P in its own process, to SIGKILL, SIGSTOP and restart on its port: the fake
    dev server (`fake_server`) or the real one on a checkpoint (`devserver_process`)."""

    def __init__(self, argv: list[str], port: int | None = None, start_timeout_s: float = 30.0):
        self.argv, self.port, self.start_timeout_s = list(argv), port or free_port(), start_timeout_s
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerProcess":
        """(Re)start on the same port and wait until /health answers."""
        self.proc = subprocess.Popen(
            [*self.argv, f"--port={self.port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            assert self.proc.poll() is None, f"{self.argv[1]} on port {self.port} exited"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return self
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, f"{self.argv[1]} on port {self.port} not up"
                time.sleep(0.05)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def hang(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.kill()


def cli_flags(**flags) -> list[str]:
    """Command-line options from keywords: max_len=32 -> --max-len=32, poisoned=True -> --poisoned."""
    return [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in flags.items()]


def devserver_argv(model_path: str, **flags) -> list[str]:
    """`python -m ipa_jax.engines.devserver --model PATH` with `flags` (`cli_flags`)."""
    return [sys.executable, "-m", "ipa_jax.engines.devserver", "--model", model_path, *cli_flags(**flags)]


def http(
    url: str,
    path: str,
    body=None,
    *,
    raw: bytes | None = None,
    method: str | None = None,
    headers=None,
    timeout_s: float = 30.0,
) -> tuple[int, object]:
    """One call to a server: `body` as JSON, or `raw` bytes as they are (by default POST with one, GET without) ->
    (status, the parsed JSON or the text)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text
