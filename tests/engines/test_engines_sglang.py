"""SGLangEngine against two dev servers over real HTTP on localhost."""

import asyncio
import json
import os
import socket
import warnings

import ml_dtypes
import numpy as np
import pytest
from engine_fakes import (
    ROUTED_LAYOUT,
    expected_tokens,
    fake_routed,
    start_fake_server,
    token_logprob,
    write_fake_weights,
)
from tiny_models import tiny_qwen3_config

from ipa_jax.engines import EngineError, SamplingParams, SGLangEngine, SGLangHTTPError
from ipa_jax.engines.devserver import KNOWN_SAMPLING_KEYS
from ipa_jax.engines.sglang import SENT_SAMPLING_KEYS, PoolUnavailable, to_sglang_sampling_params
from ipa_jax.models import init_model
from ipa_jax.models.hf_io import SafetensorsReader, hf_tensors

FAST = dict(backoff_s=0.05, max_backoff_s=0.2, probe_interval_s=0.1, down_after_failures=2, request_timeout_s=30)


@pytest.fixture()
def servers():
    started = [start_fake_server(step_s=0.005), start_fake_server(step_s=0.005)]
    yield started
    for s in started:
        if s._thread is not None:
            s.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_only_known_sampling_keys_are_sent():
    sp = to_sglang_sampling_params(SamplingParams(5, top_k=0, stop_token_ids=[3], stop=["x"]), 5)
    assert set(sp) <= set(SENT_SAMPLING_KEYS) <= set(KNOWN_SAMPLING_KEYS)
    assert sp["top_k"] == -1 and sp["max_new_tokens"] == 5  # SGLang rejects top_k == 0


def test_batch_generate_spreads_over_servers(servers):
    prompts = [[i, i + 1, 3] for i in range(8)]

    async def go():
        eng = SGLangEngine([s.url for s in servers], **FAST)
        try:
            return await eng.generate(prompts, SamplingParams(max_new_tokens=6)), eng
        finally:
            await eng.close()

    results, eng = run(go())
    for p, r in zip(prompts, results):
        assert r.token_ids == expected_tokens(p, 6)
        assert r.logprobs == pytest.approx([token_logprob(t) for t in r.token_ids])
        assert r.finish_reason == "length" and r.matched_stop is None and r.weight_version == 0
    served = [len(s.engine.finished) for s in servers]
    assert sum(served) == 8 and min(served) >= 2  # least-loaded routing used both


def test_stop_length_abort_and_sticky_sessions(servers):
    prompt = [3, 1, 4]
    full = expected_tokens(prompt, 8)

    async def go():
        eng = SGLangEngine([s.url for s in servers], **FAST)
        try:
            stop, length = await eng.generate(
                [prompt, prompt], [SamplingParams(8, stop_token_ids=[full[3]]), SamplingParams(8)]
            )
            assert stop.finish_reason == "stop" and stop.matched_stop == full[3]
            assert stop.token_ids == full[: full.index(full[3]) + 1]
            assert length.finish_reason == "length" and length.token_ids == full

            long = asyncio.create_task(eng.generate([prompt], SamplingParams(5000), request_ids=["ep7-turn0"]))
            await asyncio.sleep(0.2)
            await eng.abort(["ep7"])
            (aborted,) = await long
            assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 5000
            assert aborted.token_ids == expected_tokens(prompt, len(aborted.token_ids))

            # one session stays on one server across turns while the other server is idle
            for turn in range(4):
                await eng.generate([prompt + [turn]], SamplingParams(2), session_ids=["episode-1"])
            urls = {eng._sticky["episode-1"]}
            assert len(urls) == 1
        finally:
            await eng.close()

    run(go())


@pytest.mark.parametrize("partial", ["finish", "abort_resume"])
def test_weight_update_changes_outputs_and_version_and_treats_inflight_as_partial_says(servers, tmp_path, partial):
    prompt = [2, 2, 2]
    ckpt = write_fake_weights(str(tmp_path / "step1"), offset=5)

    async def go():
        eng = SGLangEngine([s.url for s in servers], partial=partial, **FAST)
        try:
            (before,) = await eng.generate([prompt], SamplingParams(6))
            inflight = asyncio.create_task(eng.generate([prompt] * 4, SamplingParams(150)))
            while sum(n > 0 for s in servers for n in s.engine.generated()) < 4:  # all 4 decoding (load-proof)
                await asyncio.sleep(0.01)
            await eng.update_weights(ckpt, 1)
            waited = inflight.done()
            assert eng.weight_version == 1
            (after,) = await eng.generate([prompt], SamplingParams(6))
            return before, after, await inflight, waited, eng.partial_counts()
        finally:
            await eng.close()

    before, after, inflight, waited, counts = run(go())
    assert before.weight_version == 0 and after.weight_version == 1
    assert after.token_ids == expected_tokens(prompt, 6, offset=5) != before.token_ids
    for s in servers:
        assert s.engine.weight_version == 1
    old = expected_tokens(prompt, 150)
    if partial == "finish":  # the sync waited for them: every token from the old weights
        assert waited and counts.interrupted == counts.resumed == 0 and counts.updates == 1
        for r in inflight:
            assert r.token_ids == old and r.weight_version == 0 and r.token_versions == [0] * 150
        return
    # abort_resume: aborted by the pause and resubmitted with the remaining budget: the first k tokens follow the old
    # weights, the rest the new ones, the total is exactly max_new_tokens, and each token has its version
    assert not waited and counts.interrupted == counts.resumed == 4 and counts.updates == 1
    for r in inflight:
        assert len(r.token_ids) == 150 and r.finish_reason == "length" and r.weight_version == 1
        k = next(i for i, (a, b) in enumerate(zip(r.token_ids, old)) if a != b)
        assert 0 < k < 150
        assert r.token_ids[k:] == expected_tokens(prompt + r.token_ids[:k], 150 - k, offset=5)
        split = r.token_versions.index(1)  # the new weights may repeat the old ones' next token
        assert r.token_versions == [0] * split + [1] * (150 - split) and split <= k
        assert r.token_ids[:split] == old[:split]
        assert r.token_ids[split:] == expected_tokens(prompt + r.token_ids[:split], 150 - split, offset=5)


def test_push_weights_writes_bfloat16_folders_the_pool_loads_and_prunes_the_older(servers, tmp_path):
    model = init_model(tiny_qwen3_config(moe=True), seed=3)
    weights = tmp_path / "weights"
    os.makedirs(weights / "v00000009")  # synced by a killed run after the checkpoint its rerun resumed from

    async def go():
        eng = SGLangEngine([s.url for s in servers], weights_dir=weights, keep_weight_folders=2, **FAST)
        try:
            for version in (1, 2, 3):
                await eng.push_weights(model, version)
            return eng.weight_version
        finally:
            await eng.close()

    assert run(go()) == 3 and all(s.engine.weight_version == 3 for s in servers)
    assert sorted(os.listdir(weights)) == ["v00000002", "v00000003"]
    reader = SafetensorsReader(weights / "v00000003")
    expected = hf_tensors(model)  # float32, rounded to bfloat16 by NumPy below
    assert sorted(reader.keys()) == sorted(expected)
    for name, value in expected.items():
        assert reader.get(name).dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(reader.get(name), value.astype(ml_dtypes.bfloat16), err_msg=name)
    assert json.load(open(weights / "v00000003" / "config.json"))["torch_dtype"] == "bfloat16"


def test_push_weights_needs_a_weights_dir(servers):
    with pytest.raises(EngineError, match="weights_dir"):
        run(SGLangEngine([servers[0].url], **FAST).push_weights(init_model(tiny_qwen3_config()), 1))


def test_killed_server_requests_retried_none_lost_and_comeback_used(servers, tmp_path):
    prompts = [[7, i, i * 3 % 11] for i in range(12)]
    killed = servers[0]
    port = killed.port
    ckpt = write_fake_weights(str(tmp_path / "v1"), offset=3)

    async def go():
        eng = SGLangEngine([s.url for s in servers], **FAST)
        try:
            task = asyncio.create_task(
                eng.generate(prompts, SamplingParams(40), request_ids=[f"r{i}" for i in range(12)])
            )
            await asyncio.sleep(0.1)
            await asyncio.to_thread(killed.kill)
            results = await task
            assert eng.servers[0].down
            await eng.update_weights(ckpt, 1)  # only the live server can take it now
            revived = await asyncio.to_thread(start_fake_server, port=port)  # restarts on old weights (v0)
            for _ in range(100):  # the probe on /health_generate brings it back, synced to v1 first
                if not eng.servers[0].down:
                    break
                await asyncio.sleep(0.05)
            assert not eng.servers[0].down
            more = await eng.generate([[1, 2]] * 6, SamplingParams(3))
            return results, revived, more
        finally:
            await eng.close()

    results, revived, more = run(go())
    try:
        assert len(results) == 12
        for p, r in zip(prompts, results):  # each prompt got its own complete, correct continuation
            assert r.token_ids == expected_tokens(p, 40) and r.finish_reason == "length"
        survivor = servers[1].engine
        finished_before_update = [rid for rid in survivor.finished if rid.startswith("r")]
        assert len(finished_before_update) == len(set(finished_before_update))  # no request ran twice there
        assert len({rid.rsplit("-", 1)[0] for rid in finished_before_update}) > 6  # it took over the killed share
        assert revived.engine.weight_version == 1  # brought to the pool's weights before taking requests
        assert all(r.token_ids == expected_tokens([1, 2], 3, offset=3) and r.weight_version == 1 for r in more)
        assert any(not rid.startswith("HEALTH_CHECK") for rid in revived.engine.finished)  # used again
    finally:
        revived.shutdown()


def test_http_errors_name_the_url(servers):
    async def go():
        eng = SGLangEngine([servers[0].url], **FAST)
        try:
            with pytest.raises(SGLangHTTPError) as err:  # the fake has no tokenizer -> 400
                await eng.generate([[1]], SamplingParams(3, stop=["</tool_call>"]))
            assert servers[0].url in str(err.value) and "HTTP 400" in str(err.value)
            assert "tokenizer" in str(err.value)
            with pytest.raises(EngineError, match="Failed to update weights") as err:
                await eng.update_weights("/does/not/exist", 3)
            assert servers[0].url in str(err.value) and eng.weight_version == 0
        finally:
            await eng.close()

    run(go())


def test_all_servers_down_raises_naming_urls():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def go():
        eng = SGLangEngine([dead], **{**FAST, "max_attempts": 3, "outage_budget_s": 0.3})
        try:  # once it is marked down, the request waits for it for the outage budget, then gives up
            with pytest.raises(PoolUnavailable, match=dead.replace(".", r"\.")):
                await eng.generate([[1]], SamplingParams(2))
            assert not await eng.health()
        finally:
            await eng.close()

    run(go())


def test_truncation_warning_once_and_routed_experts(servers):
    async def go():
        eng = SGLangEngine([servers[0].url], routed_experts_layout=ROUTED_LAYOUT, **FAST)
        try:
            with pytest.warns(UserWarning, match="top_p"):
                await eng.generate([[1]], SamplingParams(2, top_p=0.9))
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                await eng.generate([[1]], SamplingParams(2, top_k=5))
            (r,) = await eng.generate([[1, 2, 3]], SamplingParams(4, return_routed_experts=True))
            np.testing.assert_array_equal(r.routed_experts, fake_routed(3 + 4))
            assert r.routed_experts.shape == (3 + 4 - 1, *ROUTED_LAYOUT)
        finally:
            await eng.close()

    run(go())
    with pytest.raises(ValueError, match="routed_experts_layout"):
        run(SGLangEngine(["http://127.0.0.1:1"]).generate([[1]], SamplingParams(2, return_routed_experts=True)))


def test_constructor_and_argument_validation():
    with pytest.raises(ValueError, match="empty"):
        SGLangEngine([])
    with pytest.raises(ValueError, match="http://"):
        SGLangEngine(["localhost:3000"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(3, top_p=1.5)
    with pytest.raises(ValueError, match="session_ids"):
        run(SGLangEngine(["http://127.0.0.1:1"]).generate([[1], [2]], SamplingParams(2), session_ids=["a"]))


def test_timeout_retries_on_another_server():
    hung, fast = start_fake_server(step_s=10.0), start_fake_server()
    prompts = [[5, i] for i in range(4)]

    async def go():
        eng = SGLangEngine([hung.url, fast.url], **{**FAST, "request_timeout_s": 0.5})
        try:
            return await eng.generate(prompts, SamplingParams(3))
        finally:
            await eng.close()

    try:
        results = run(go())
        assert [r.token_ids for r in results] == [expected_tokens(p, 3) for p in prompts]
        assert len(hung.engine.started) >= 1 and len(fast.engine.finished) == 4  # some went to the hung one first
    finally:
        hung.shutdown()
        fast.shutdown()
