"""Starting SGLang servers for the rollout pool: the launch commands, the readiness wait, the foreground loop.

One `python -m sglang.launch_server` per URL (host:port), each on its own GPUs (`--base-gpu-id`), with the flags
the trainer relies on: `--weight-version` (versions read back after every weight sync),
`--enable-return-routed-experts` (MoE routing replay; SGLang >= 0.5.7), `--mem-fraction-static`, `--api-key` (every
route but /health* then needs `Authorization: Bearer <key>`), `--admin-api-key` (the key of the admin-level routes:
pause, weight updates, ...); printed commands show keys as ***. Readiness is
`GET /health_generate` (a real one-token generation) on every server. Needs the `sglang` extra and a CUDA GPU;
`missing_requirements` says what is missing (on a CPU machine use `python -m ipa_jax.engines.devserver`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

EXIT_MISSING_REQUIREMENTS = 2


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    model_path: str
    urls: tuple[str, ...]
    weight_version: int = 0
    routed_experts: bool = False
    mem_fraction_static: float = 0.85
    tp_size: int = 1
    dtype: str = "auto"
    context_length: int = 0  # 0: the model's own
    skip_tokenizer_init: bool = False  # token ids only (the client sends ids; stop strings then do not work)
    extra_args: tuple[str, ...] = ()
    api_key: str = ""  # SGLang's --api-key; "" = none
    admin_api_key: str = ""  # SGLang's --admin-api-key; "" = none


def parse_url(url: str) -> tuple[str, int]:
    """ "http://host:port" -> (host, port); raises ValueError naming the URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None or parts.path not in ("", "/"):
        raise ValueError(f"server URL must look like http://host:port, got {url!r}")
    return parts.hostname, parts.port


def build_commands(cfg: LaunchConfig, python: str = sys.executable) -> list[list[str]]:
    """One `python -m sglang.launch_server ...` argv per URL; the i-th server of a host uses its GPUs
    [i*tp, (i+1)*tp) (run each command on the host its URL names)."""
    if not cfg.model_path:
        raise ValueError("model_path is empty: pass --model_path or set model.path in the config")
    if not cfg.urls:
        raise ValueError("no server URLs: pass --ports/--host or set rollout.sglang_urls in the config")
    if not 0.0 < cfg.mem_fraction_static < 1.0:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {cfg.mem_fraction_static}")
    if cfg.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {cfg.tp_size}")
    commands = []
    per_host: dict[str, int] = {}
    for url in cfg.urls:
        host, port = parse_url(url)
        i = per_host[host] = per_host.get(host, -1) + 1
        cmd = [
            python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            cfg.model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--weight-version",
            str(cfg.weight_version),
            "--mem-fraction-static",
            str(cfg.mem_fraction_static),
            "--tp-size",
            str(cfg.tp_size),
            "--base-gpu-id",
            str(i * cfg.tp_size),
            "--dtype",
            cfg.dtype,
            "--skip-server-warmup",  # readiness is our /health_generate poll
        ]
        if cfg.routed_experts:
            cmd.append("--enable-return-routed-experts")
        if cfg.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if cfg.context_length:
            cmd += ["--context-length", str(cfg.context_length)]
        if cfg.api_key:
            cmd += ["--api-key", cfg.api_key]
        if cfg.admin_api_key:
            cmd += ["--admin-api-key", cfg.admin_api_key]
        commands.append(cmd + list(cfg.extra_args))
    return commands


KEY_FLAGS = ("--api-key", "--admin-api-key")


def shown(cmd: Sequence[str]) -> str:
    """A command as printed: the API keys masked."""
    return " ".join("***" if i and cmd[i - 1] in KEY_FLAGS else arg for i, arg in enumerate(cmd))


def missing_requirements() -> str | None:
    """None when SGLang can run here, else a message saying what is missing."""
    problems = []
    if importlib.util.find_spec("sglang") is None:
        problems.append("the `sglang` package is not installed (pip install 'ipa_jax[sglang]' on a CUDA host)")
    cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        cuda = torch.cuda.is_available()
    elif shutil.which("nvidia-smi"):
        cuda = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    if not cuda:
        problems.append("no CUDA GPU is visible (SGLang publishes no CPU kernels)")
    if not problems:
        return None
    return (
        "launch_sglang: cannot start SGLang servers: " + "; ".join(problems) + ".\n"
        "On a CPU machine use the SGLang-compatible dev server instead:\n"
        "  python -m ipa_jax.engines.devserver --model PATH --port 30000"
    )


def wait_healthy(urls: Sequence[str], procs: Sequence[subprocess.Popen], timeout_s: float, logs: Sequence[str]) -> None:
    """Poll GET /health_generate on every server until 200; raises RuntimeError if a server exits or times out."""
    pending = dict(zip(urls, zip(procs, logs)))
    deadline = time.time() + timeout_s
    while pending:
        for url, (proc, log) in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang server for {url} exited with status {proc.returncode}; log: {log}")
            try:
                with urllib.request.urlopen(url + "/health_generate", timeout=30) as resp:
                    if resp.status == 200:
                        print(f"ready: {url}", flush=True)
                        del pending[url]
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        if pending and time.time() > deadline:
            raise RuntimeError(f"SGLang servers not healthy after {timeout_s:.0f}s: {sorted(pending)}")
        if pending:
            time.sleep(2.0)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def serve(cfg: LaunchConfig, commands: Sequence[Sequence[str]], log_dir: str, wait_timeout_s: float) -> int:
    """Starts the servers (one log file each in `log_dir`), waits until all generate, prints their URLs and the
    matching config override, then keeps them in the foreground until Ctrl-C / SIGTERM or a server exits (which
    stops the others). Returns the exit status."""
    os.makedirs(log_dir, exist_ok=True)
    procs, logs = [], []
    try:
        for url, cmd in zip(cfg.urls, commands):
            log = os.path.join(log_dir, f"sglang_{parse_url(url)[1]}.log")
            print("starting:", shown(cmd), flush=True)
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
            logs.append(log)
        wait_healthy(cfg.urls, procs, wait_timeout_s, logs)
        print("SGLang servers ready:")
        for url in cfg.urls:
            print(f"  {url}")
        print(
            "config override: --config.rollout.engine=sglang --config.rollout.sglang_urls='("
            + ", ".join(f'"{u}"' for u in cfg.urls)
            + ",)'",
            flush=True,
        )
        signal.signal(signal.SIGTERM, _interrupt)
        while all(p.poll() is None for p in procs):
            time.sleep(5.0)
        print("an SGLang server exited; stopping the others", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"launch_sglang: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
