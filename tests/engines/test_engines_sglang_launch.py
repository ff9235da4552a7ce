"""ipa_jax.engines.sglang_launch and experiments/launch_sglang.py: command construction, the clear exit without
sglang / CUDA, the dry run reading a config."""

import os
import subprocess
import sys

import pytest

from ipa_jax.engines import sglang_launch as m

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "experiments", "launch_sglang.py")


def test_build_commands_flags_and_gpu_assignment():
    cfg = m.LaunchConfig(
        model_path="/ckpt/step0",
        urls=("http://127.0.0.1:30000", "http://127.0.0.1:30001", "http://10.0.0.2:30000"),
        weight_version=7,
        routed_experts=True,
        mem_fraction_static=0.7,
        tp_size=2,
        extra_args=("--x", "1"),
    )
    cmds = m.build_commands(cfg, python="py")
    assert len(cmds) == 3
    for cmd in cmds:
        assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
        args = dict(zip(cmd[3::1], cmd[4::1]))
        assert args["--model-path"] == "/ckpt/step0" and args["--weight-version"] == "7"
        assert args["--mem-fraction-static"] == "0.7" and args["--tp-size"] == "2"
        assert "--enable-return-routed-experts" in cmd and cmd[-2:] == ["--x", "1"]
        assert "--skip-tokenizer-init" not in cmd
    hosts_ports_gpus = [
        (c[c.index("--host") + 1], c[c.index("--port") + 1], c[c.index("--base-gpu-id") + 1]) for c in cmds
    ]
    assert hosts_ports_gpus == [("127.0.0.1", "30000", "0"), ("127.0.0.1", "30001", "2"), ("10.0.0.2", "30000", "0")]
    plain = m.build_commands(m.LaunchConfig("/m", ("http://h:1",), skip_tokenizer_init=True), python="py")[0]
    assert "--enable-return-routed-experts" not in plain and "--skip-tokenizer-init" in plain


def test_the_api_key_is_passed_and_never_shown():
    (cmd,) = m.build_commands(m.LaunchConfig("/m", ("http://h:1",), api_key="s3cret"), python="py")
    assert cmd[cmd.index("--api-key") + 1] == "s3cret"
    assert "s3cret" not in m.shown(cmd) and "--api-key ***" in m.shown(cmd)
    assert "--api-key" not in m.build_commands(m.LaunchConfig("/m", ("http://h:1",)), python="py")[0]


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(model_path="", urls=("http://h:1",)), "model_path"),
        (dict(model_path="/m", urls=()), "URLs"),
        (dict(model_path="/m", urls=("h:1",)), "http://host:port"),
        (dict(model_path="/m", urls=("http://h",)), "http://host:port"),
        (dict(model_path="/m", urls=("http://h:1",), mem_fraction_static=1.5), "mem_fraction_static"),
    ],
)
def test_build_commands_rejects_bad_settings(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        m.build_commands(m.LaunchConfig(**kw))


needs_no_sglang = pytest.mark.skipif(m.missing_requirements() is None, reason="sglang and CUDA are available here")


@needs_no_sglang
def test_script_exits_clearly_without_sglang_or_cuda():
    out = subprocess.run(
        [sys.executable, SCRIPT, "--model_path=/m", "--ports=30000"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2
    assert "cannot start SGLang servers" in out.stderr and "ipa_jax.engines.devserver" in out.stderr
    assert out.stdout == ""  # nothing was started


def test_script_dry_run_reads_the_config():
    urls = "('http://127.0.0.1:31000','http://127.0.0.1:31001')"
    out = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--config=configs/base.py",
            "--config.model.path=/ckpt",
            f"--config.rollout.sglang_urls={urls}",
            "--config.model.routing_replay=True",
            "--dry_run",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "SGLANG_API_KEY": "s3cret", "SGLANG_ADMIN_API_KEY": "adm1n"},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2
    assert all("-m sglang.launch_server --model-path /ckpt" in line for line in lines)
    assert "--port 31000" in lines[0] and "--port 31001" in lines[1] and "--base-gpu-id 1" in lines[1]
    assert all("--enable-return-routed-experts" in line for line in lines)
    assert all("--api-key *** --admin-api-key ***" in line for line in lines)  # from rollout.(admin_)api_key_env
    assert "s3cret" not in out.stdout and "adm1n" not in out.stdout
