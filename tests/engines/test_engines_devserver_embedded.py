"""The embedded engine behind the dev server: SGLangEngine over real HTTP on two in-process servers, and the
`python -m ipa_jax.engines.devserver` CLI as a subprocess. Outputs must equal the engine called directly.

Shapes match test_embedded.py (3 prompts in a batch bucket of 4, prompt + max_new <= 32, routed experts on),
so the compiled prefill/decode are shared within one pytest process."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from tiny_models import make_tiny_hf_checkpoint

from ipa_jax.engines import SamplingParams, SGLangEngine
from ipa_jax.engines.devserver import DevServer
from ipa_jax.engines.embedded import EmbeddedEngine
from ipa_jax.models import from_pretrained

PROMPTS = [[1, 5, 9], [2, 7, 11, 13, 17, 19, 23], [3, 4]]
GREEDY = SamplingParams(20, temperature=0.0, return_routed_experts=True)
ENGINE_KW = dict(max_len=64, max_batch=4, batch_buckets=(4,))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("devserver_embedded")
    return make_tiny_hf_checkpoint(base / "a", seed=0), make_tiny_hf_checkpoint(base / "b", seed=1)


@pytest.fixture(scope="module")
def direct(ckpts):
    """Greedy results of the engine called directly, on checkpoint a and on checkpoint b."""

    async def go():
        eng = EmbeddedEngine(from_pretrained(ckpts[0]), **ENGINE_KW)
        try:
            a = await eng.generate(PROMPTS, GREEDY)
            eng.set_params_from_model(from_pretrained(ckpts[1]), 1)
            return a, await eng.generate(PROMPTS, GREEDY)
        finally:
            await eng.close()

    return asyncio.run(go())


def test_sglang_client_on_two_embedded_dev_servers(ckpts, direct):
    servers = [
        DevServer(
            EmbeddedEngine(from_pretrained(ckpts[0]), **ENGINE_KW),
            model_path=ckpts[0],
            enable_return_routed_experts=True,
        ).serve_in_thread()
        for _ in range(2)
    ]

    async def go():
        eng = SGLangEngine([s.url for s in servers], routed_experts_layout=(2, 2), backoff_s=0.05)
        try:
            before = await eng.generate(PROMPTS, GREEDY)
            await eng.update_weights(ckpts[1], 1)
            after = await eng.generate(PROMPTS, GREEDY)
            return before, after
        finally:
            await eng.close()

    try:
        before, after = asyncio.run(asyncio.wait_for(go(), 120))
        for got, want, version in ((before, direct[0], 0), (after, direct[1], 1)):
            for g, w in zip(got, want):
                assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason == "length"
                np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6)
                np.testing.assert_array_equal(g.routed_experts, w.routed_experts)
                assert g.weight_version == version
        assert [r.token_ids for r in before] != [r.token_ids for r in after]
        assert all(s.engine.num_batches >= 1 for s in servers)  # both servers served
        assert all(s.engine.weight_version == 1 and s.model_path == ckpts[1] for s in servers)
    finally:
        for s in servers:
            s.shutdown()


def test_seeded_requests_sample_alike_through_the_sglang_client(ckpts):
    """A sampling_seed travels in sampling_params (SGLang's key): over HTTP, on either of two servers, a seeded request
    samples the tokens the engine gives it directly, alone or beside the others; another seed samples others."""
    seeded = [SamplingParams(20, temperature=1.0, sampling_seed=seed) for seed in (5, 6, 7)]
    servers = [
        DevServer(EmbeddedEngine(from_pretrained(ckpts[0]), **ENGINE_KW), model_path=ckpts[0]).serve_in_thread()
        for _ in range(2)
    ]

    async def go():
        direct = EmbeddedEngine(from_pretrained(ckpts[0]), **ENGINE_KW)
        eng = SGLangEngine([s.url for s in servers], backoff_s=0.05)
        try:
            want = await direct.generate(PROMPTS, seeded)
            together = await eng.generate(PROMPTS, seeded)
            alone = [(await eng.generate([p], [params]))[0] for p, params in zip(PROMPTS, seeded)]
            other = await eng.generate(PROMPTS, [SamplingParams(20, temperature=1.0, sampling_seed=8)] * 3)
            return want, together, alone, other
        finally:
            await eng.close()
            await direct.close()

    try:
        want, together, alone, other = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        for s in servers:
            s.shutdown()
    assert [r.token_ids for r in together] == [r.token_ids for r in alone] == [r.token_ids for r in want]
    assert all(o.token_ids != w.token_ids for o, w in zip(other, want))


def test_sglang_client_counts_the_servers_cached_tokens(ckpts, direct):
    """A second turn sent over HTTP finds its first turn's row in the embedded engine behind the dev server: the
    server reports the reused tokens as meta_info.cached_tokens, the client as each result's cached_tokens and in
    prefix_counts(), equal to the engine's own counts."""
    server = DevServer(
        EmbeddedEngine(from_pretrained(ckpts[0]), **ENGINE_KW), model_path=ckpts[0], enable_return_routed_experts=True
    ).serve_in_thread()

    async def go():
        eng = SGLangEngine([server.url], routed_experts_layout=(2, 2), backoff_s=0.05)
        try:
            assert eng.prefix_counts() is None  # nothing reported yet
            first = await eng.generate(PROMPTS, GREEDY)
            second = [p + r.token_ids + [5, 6] for p, r in zip(PROMPTS, first)]
            return first, await eng.generate(second, GREEDY), eng.prefix_counts()
        finally:
            await eng.close()

    try:
        first, second, counts = asyncio.run(asyncio.wait_for(go(), 120))
        assert [r.token_ids for r in first] == [r.token_ids for r in direct[0]]
        assert [r.cached_tokens for r in first] == [0, 0, 0]
        # each row's cache: its prompt and the 19 output tokens it fed (the 20th was sampled, never fed)
        assert [r.cached_tokens for r in second] == [len(p) + 19 for p in PROMPTS]
        assert counts == server.engine.prefix_counts()
        assert counts.reused == sum(len(p) + 19 for p in PROMPTS) and counts.prefilled == sum(map(len, PROMPTS)) + 9
    finally:
        server.shutdown()


def _http(url, body=None):
    req = urllib.request.Request(
        url, data=None if body is None else json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        text = resp.read().decode()
        return resp.status, (json.loads(text) if text else None)


def test_devserver_cli_subprocess(ckpts, direct):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ipa_jax.engines.devserver",
        "--model",
        ckpts[0],
        "--port",
        str(port),
        "--max-len",
        "64",
        "--max-batch",
        "4",
        "--batch-buckets",
        "4",
        "--enable-return-routed-experts",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 150
        while True:
            assert proc.poll() is None, f"dev server exited:\n{proc.stdout.read()}"
            try:
                if _http(url + "/health_generate")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.time() < deadline, "dev server did not become healthy"
            time.sleep(0.5)
        status, outs = _http(
            url + "/generate",
            {
                "input_ids": PROMPTS,
                "sampling_params": {"max_new_tokens": 20, "temperature": 0},
                "return_logprob": True,
                "return_routed_experts": True,
            },
        )
        assert status == 200 and len(outs) == 3
        for out, want in zip(outs, direct[0]):
            assert out["output_ids"] == want.token_ids
            assert [x[1] for x in out["meta_info"]["output_token_logprobs"]] == want.token_ids
            assert out["meta_info"]["weight_version"] == "0"
        assert _http(url + "/get_model_info")[1]["model_path"] == ckpts[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stdout.read()
