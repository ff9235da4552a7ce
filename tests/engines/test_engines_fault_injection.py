"""Faults injected into dev servers running in their own processes (tests/engines/fake_devserver.py) on loopback:
real SIGKILL and SIGSTOP during weight syncs and requests, servers restarted on their port, hostile requests. Every
wait is bounded by the client's configured timeouts; the pipeline-level faults are in
tests/pipeline/test_pipeline_fault_injection.py."""

import asyncio
import os
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from engine_fakes import expected_tokens, write_fake_weights
from server_process import http

from ipa_jax.engines import SamplingParams, SGLangEngine, SGLangHTTPError
from ipa_jax.engines.sglang import PoolUnavailable

# Seconds, not the production minutes: each hang costs the test at most these.
FAST = dict(
    backoff_s=0.05,
    max_backoff_s=0.2,
    probe_interval_s=0.1,
    down_after_failures=1,
    request_timeout_s=1.0,
    control_timeout_s=1.0,
    outage_budget_s=10.0,
)


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def served_version(server, api_key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return int(http(server.url, "/get_model_info", headers=headers)[1]["weight_version"])


def generates(server, timeout_s: float = 3.0) -> bool:
    """Whether the server answers a generation at once (a paused one holds it)."""
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    try:
        return http(server.url, "/generate", body, timeout_s=timeout_s)[0] == 200
    except (TimeoutError, urllib.error.URLError):
        return False


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_a_server_dying_between_pause_and_continue_does_not_fail_the_sync(fake_server, tmp_path):
    """One of two servers is SIGKILLed while it loads the new weights: the survivor serves them, the client's
    version is the survivor's, and the dead server, restarted on its old weights, is resynced before it serves."""
    survivor, victim = fake_server(update_delay_s=0.5), fake_server(update_delay_s=0.5)
    ckpt = write_fake_weights(str(tmp_path / "v1"), offset=3)

    async def go():
        eng = SGLangEngine([survivor.url, victim.url], **FAST)
        try:
            sync = asyncio.create_task(eng.update_weights(ckpt, 1))
            await asyncio.sleep(0.25)  # both paused, both loading
            await asyncio.to_thread(victim.kill)
            await sync
            assert eng.weight_version == served_version(survivor) == 1 and eng.servers[1].down
            await asyncio.to_thread(victim.start)  # comes back at version 0, not paused
            await until(lambda: not eng.servers[1].down)
            assert served_version(victim) == 1
            prompts = [[4, i] for i in range(8)]
            results = await eng.generate(prompts, SamplingParams(3))
            assert [r.token_ids for r in results] == [expected_tokens(p, 3, offset=3) for p in prompts]
            assert {r.weight_version for r in results} == {1} and eng.servers[1].served > 0
        finally:
            await eng.close()

    run(go())


def test_a_pool_down_during_a_sync_waits_within_the_outage_budget(fake_server, tmp_path):
    """Both servers SIGKILLed before a sync: it waits (probing) and succeeds once they are back; without them it
    gives up after the outage budget with PoolUnavailable naming the servers."""
    servers = [fake_server(), fake_server()]
    ckpt = write_fake_weights(str(tmp_path / "v1"), offset=3)

    async def restart_later():
        await asyncio.sleep(1.0)
        for s in servers:
            await asyncio.to_thread(s.start)

    async def go():
        eng = SGLangEngine([s.url for s in servers], **FAST)
        try:
            for s in servers:
                s.kill()
            restart = asyncio.create_task(restart_later())
            await eng.update_weights(ckpt, 1)  # done once the first is back; the other is resynced when back
            await restart
            await until(lambda: not any(s.down for s in eng.servers))
            assert eng.weight_version == 1 and [served_version(s) for s in servers] == [1, 1]
            for s in servers:
                s.kill()
            eng.outage_budget_s = 0.5
            t0 = time.monotonic()
            with pytest.raises(PoolUnavailable, match="outage budget") as error:
                await eng.update_weights(ckpt, 2)
            assert time.monotonic() - t0 < 3 and all(s.url in str(error.value) for s in servers)
            assert eng.weight_version == 1
        finally:
            await eng.close()

    run(go())


def test_a_hung_server_costs_at_most_the_timeouts_and_comes_back_resumed(fake_server, tmp_path):
    """A SIGSTOPped server: requests to it are retried elsewhere after request_timeout_s; a sync it hangs in (after
    its pause, while loading) goes on without it after control_timeout_s. After SIGCONT it is still paused: the
    probe resumes it before routing to it, so requests sent to it generate."""
    hung, healthy = fake_server(update_delay_s=0.5), fake_server(update_delay_s=0.5)
    ckpt = write_fake_weights(str(tmp_path / "v1"), offset=5)

    async def go():
        eng = SGLangEngine([hung.url, healthy.url], **FAST)
        try:
            hung.hang()
            prompts = [[9, i] for i in range(4)]
            t0 = time.monotonic()
            results = await eng.generate(prompts, SamplingParams(3))
            assert [r.token_ids for r in results] == [expected_tokens(p, 3) for p in prompts]
            assert time.monotonic() - t0 < 1.0 + 2.0 and eng.servers[0].down
            hung.resume()
            await until(lambda: not eng.servers[0].down)
            sync = asyncio.create_task(eng.update_weights(ckpt, 1))
            await asyncio.sleep(0.25)  # paused, loading
            hung.hang()
            t0 = time.monotonic()
            await sync
            assert time.monotonic() - t0 < 1.0 + 2.0 and eng.weight_version == 1 and eng.servers[0].down
            hung.resume()
            await until(lambda: not eng.servers[0].down)
            assert served_version(hung) == 1 and await asyncio.to_thread(generates, hung)
        finally:
            await eng.close()

    run(go())


def test_cancelling_a_sync_while_a_server_hangs_leaves_no_server_paused(fake_server, tmp_path):
    """The sync is cancelled while the hung server holds its pause: it returns at once, the healthy server is
    resumed and the client's version is the one the healthy server serves; the hung one, back, is resynced and
    resumed before it is used."""
    hung, healthy = fake_server(), fake_server()
    ckpt = write_fake_weights(str(tmp_path / "v1"), offset=5)

    async def go():
        eng = SGLangEngine([hung.url, healthy.url], **{**FAST, "control_timeout_s": 30.0})
        try:
            hung.hang()
            sync = asyncio.create_task(eng.update_weights(ckpt, 1))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            sync.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sync
            assert time.monotonic() - t0 < 2.0
            assert await asyncio.to_thread(generates, healthy)  # not left paused
            assert eng.weight_version == served_version(healthy) and eng.servers[0].down
            (result,) = await eng.generate([[3, 3]], SamplingParams(2))  # the client is not left holding requests
            assert result.weight_version == eng.weight_version
            hung.resume()
            await until(lambda: not eng.servers[0].down)
            assert served_version(hung) == eng.weight_version and await asyncio.to_thread(generates, hung)
        finally:
            await eng.close()

    run(go())


def test_hostile_control_requests_get_a_400(fake_server, tmp_path):
    server = fake_server()
    status, body = http(server.url, "/generate", raw=b"[" * 100_000)  # the JSON parser's recursion limit
    assert status == 400 and "nested too deeply" in body["message"]
    ckpt = write_fake_weights(str(tmp_path / "v1"), offset=1)
    for version in (-5, 2**70, True, 1.5, ["1"]):  # SGLang's weight_version is Optional[str]: a schema error
        status, body = http(server.url, "/update_weights_from_disk", {"model_path": ckpt, "weight_version": version})
        assert status == 400 and body["object"] == "error" and "weight_version" in body["message"], version
    assert served_version(server) == 0
    for version in ("2147483647", "v1.2", " 7", ""):  # any string, as SGLang takes it
        status, body = http(server.url, "/update_weights_from_disk", {"model_path": ckpt, "weight_version": version})
        assert status == 200 and body["success"] and http(server.url, "/model_info")[1]["weight_version"] == version


def test_an_api_key_is_required_and_sent_by_the_client(fake_server, tmp_path):
    server = fake_server(api_key="s3cret")
    assert http(server.url, "/health")[0] == 200  # probes and load balancers need no key
    assert http(server.url, "/get_model_info")[0] == 401
    assert http(server.url, "/get_model_info", headers={"Authorization": "Bearer wrong"})[0] == 401
    ckpt = write_fake_weights(str(tmp_path / "v1"), offset=2)
    status, _ = http(server.url, "/update_weights_from_disk", {"model_path": ckpt, "weight_version": "9"})
    assert status == 401 and served_version(server, api_key="s3cret") == 0

    async def go():
        for key, ok in (("wrong", False), ("s3cret", True)):
            eng = SGLangEngine([server.url], api_key=key, **FAST)
            try:
                if not ok:
                    with pytest.raises(SGLangHTTPError, match="HTTP 401"):
                        await eng.generate([[1]], SamplingParams(2))
                    continue
                await eng.update_weights(ckpt, 1)
                (r,) = await eng.generate([[1, 2]], SamplingParams(3))
                assert r.token_ids == expected_tokens([1, 2], 3, offset=2) and r.weight_version == 1
            finally:
                await eng.close()

    run(go())


def test_the_dev_server_refuses_non_finite_weights(tmp_path):
    """Serving NaN weights would make every rollout invalid: the update is refused and the old weights stay."""
    from safetensors.numpy import load_file, save_file
    from tiny_models import tiny_qwen3_config

    from ipa_jax.engines.devserver import DevServer
    from ipa_jax.engines.embedded import EmbeddedEngine
    from ipa_jax.models import init_model, save_pretrained

    model = init_model(tiny_qwen3_config(moe=False))
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    save_pretrained(model, good)
    save_pretrained(model, bad)
    (weights,) = [os.path.join(bad, f) for f in os.listdir(bad) if f.endswith(".safetensors")]
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = np.full_like(tensors[name], np.nan)
    save_file(tensors, weights)
    server = DevServer(EmbeddedEngine(model, max_len=32, max_batch=1), model_path=good)
    server.serve_in_thread()
    try:
        status, body = http(
            server.url, "/update_weights_from_disk", {"model_path": bad, "weight_version": "1"}, timeout_s=60
        )
        assert status == 400 and not body["success"] and "non-finite" in body["message"]
        assert served_version(server) == 0 and http(server.url, "/get_model_info")[1]["model_path"] == good
    finally:
        server.shutdown()
