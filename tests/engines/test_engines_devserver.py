"""The dev server speaks SGLang's HTTP contract (docs/sglang.md), checked over real HTTP."""

import asyncio
import json

import aiohttp
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
from server_process import http


@pytest.fixture(scope="module")
def server():
    s = start_fake_server()
    yield s
    s.shutdown()


@pytest.fixture()
def slow_server():
    s = start_fake_server(step_s=0.01)
    yield s
    s.shutdown()


def test_single_generate_response_shape(server):
    prompt = [5, 6, 7]
    status, out = http(
        server.url,
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
            "return_logprob": True,
            "rid": "abc",
        },
    )
    assert status == 200
    want = expected_tokens(prompt, 6)
    assert out["output_ids"] == want
    meta = out["meta_info"]
    assert meta["id"] == "abc"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6
    assert meta["weight_version"] == "0"
    assert meta["output_token_logprobs"] == [[pytest.approx(token_logprob(t)), t, None] for t in want]
    assert meta["input_token_logprobs"] == [[None, 7, None]]
    assert "text" not in out  # no tokenizer: token ids only (SGLang's --skip-tokenizer-init)


def test_put_and_no_logprob(server):
    status, out = http(
        server.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, method="PUT"
    )
    assert status == 200 and "output_token_logprobs" not in out["meta_info"]


def test_batch_generate_in_order_with_rids(server):
    prompts = [[1, 2, 3], [4], [9, 9]]
    status, outs = http(
        server.url,
        "/generate",
        {
            "input_ids": prompts,
            "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 4}, {"max_new_tokens": 5}],
            "return_logprob": True,
            "rid": "b",
        },
    )
    assert status == 200 and isinstance(outs, list) and len(outs) == 3
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert out["output_ids"] == expected_tokens(p, 3 + i)
        assert out["meta_info"]["id"] == f"b_{i}"
        assert [x[1] for x in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]


def test_stop_token_kept_and_matched(server):
    prompt = [3, 1, 4]
    full = expected_tokens(prompt, 8)
    stop = full[2]
    status, out = http(
        server.url,
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [stop]},
            "return_logprob": True,
        },
    )
    assert status == 200
    cut = full.index(stop) + 1
    assert out["output_ids"] == full[:cut]  # the matched stop token is included
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_model_eos_stops_unless_ignore_eos():
    from engine_fakes import FakeEngine

    from ipa_jax.engines.devserver import DevServer

    prompt = [2, 7]
    full = expected_tokens(prompt, 10)
    s = DevServer(FakeEngine(), eos_token_ids=[full[1]]).serve_in_thread()
    try:
        _, out = http(s.url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 10}})
        assert out["output_ids"] == full[: full.index(full[1]) + 1]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        sp = {"max_new_tokens": 10, "ignore_eos": True}
        _, out = http(s.url, "/generate", {"input_ids": prompt, "sampling_params": sp})
        assert out["output_ids"] == full
    finally:
        s.shutdown()


def test_default_max_new_tokens_is_sglangs_128(server):
    _, out = http(server.url, "/generate", {"input_ids": [1]})
    assert out["meta_info"]["completion_tokens"] == 128


def test_routed_experts_base64(server):
    prompt = [1, 2, 3, 4]
    _, out = http(
        server.url,
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 3},
            "return_routed_experts": True,
        },
    )
    flat = np.frombuffer(__import__("base64").b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    np.testing.assert_array_equal(flat.reshape(len(prompt) + 3 - 1, *ROUTED_LAYOUT), fake_routed(len(prompt) + 3))


VALIDATION_SHAPE = {"object", "message", "type", "param", "code"}


@pytest.mark.parametrize(
    "body, raw, schema, fragment",
    [
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "tempreature": 1.0}},
            None,
            True,
            "unknown field `tempreature`",
        ),
        (None, b"{not json", True, "JSON"),
        (None, b"[1, 2]", True, "JSON object"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, None, True, "max_new_tokens"),
        ({"input_ids": [[1], "x"]}, None, True, "input_ids[1]"),
        ({"input_ids": [1], "sampling_params": [{}, {}]}, None, True, "not a batch"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, None, True, "sampling_params has 1 entries"),
        ({"sampling_params": {}}, None, False, "input_ids"),
        ({"input_ids": [1], "text": "hi"}, None, False, "input_ids"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, None, False, "top_k"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0.0}}, None, False, "top_p"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, None, False, "sampling_params.n"),
        ({"input_ids": [1], "sampling_params": {"stop": ["</s>"]}}, None, False, "tokenizer"),
        ({"input_ids": [1], "stream": True}, None, False, "stream"),
    ],
)
def test_bad_requests_get_400_in_sglang_shapes(server, body, raw, schema, fragment):
    status, out = http(server.url, "/generate", body, raw=raw)
    assert status == 400
    if schema:  # RequestValidationError shape
        assert set(out) == VALIDATION_SHAPE and out["code"] == 400 and out["type"] == "Bad Request"
        assert fragment in out["message"]
    else:  # ValueError-while-serving shape
        assert set(out) == {"error"} and fragment in out["error"]["message"]


def test_known_default_valued_keys_accepted(server):
    sp = {
        "max_new_tokens": 2,
        "min_p": 0.0,
        "n": 1,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "repetition_penalty": 1.0,
    }
    assert http(server.url, "/generate", {"input_ids": [1], "sampling_params": sp})[0] == 200


def test_model_info_health_and_weight_update(tmp_path):
    from engine_fakes import start_fake_server

    s = start_fake_server()
    try:
        for path in ("/get_model_info", "/model_info"):
            status, info = http(s.url, path)
            assert status == 200 and info["weight_version"] == "0" and info["is_generation"] is True
        assert http(s.url, "/health")[0] == 200 and http(s.url, "/health_generate")[0] == 200
        prompt = [4, 4]
        before = http(s.url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5}})[1]
        ckpt = write_fake_weights(str(tmp_path / "w1"), offset=11)
        status, out = http(s.url, "/update_weights_from_disk", {"model_path": ckpt, "weight_version": "1"})
        assert status == 200 and out["success"] is True and "num_paused_requests" in out
        assert http(s.url, "/get_model_info")[1]["weight_version"] == "1"
        after = http(s.url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5}})[1]
        assert after["output_ids"] == expected_tokens(prompt, 5, offset=11) != before["output_ids"]
        assert after["meta_info"]["weight_version"] == "1"
        body = {"model_path": str(tmp_path / "missing"), "weight_version": "2"}
        status, out = http(s.url, "/update_weights_from_disk", body)
        assert status == 400 and out["success"] is False and "Failed to update weights" in out["message"]
        assert http(s.url, "/get_model_info")[1]["weight_version"] == "1"
        status, out = http(s.url, "/update_weights_from_disk", {"weight_version": "2"})
        assert status == 400 and "model_path" in out["message"]
    finally:
        s.shutdown()


def test_abort_pause_continue_flush(slow_server):
    url = slow_server.url

    async def run():
        async with aiohttp.ClientSession() as sess:

            async def gen(rid, n=200, prompt=(1, 2)):
                body = {
                    "input_ids": list(prompt),
                    "sampling_params": {"max_new_tokens": n},
                    "return_logprob": True,
                    "rid": rid,
                }
                async with sess.post(url + "/generate", json=body) as r:
                    return r.status, await r.json()

            async def post(path, body=None):
                async with sess.post(url + path, json=body) as r:
                    return r.status, await r.text()

            # abort by rid prefix: partial output, abort finish reason
            task = asyncio.create_task(gen("victim-1"))
            other = asyncio.create_task(gen("other", n=5))
            await asyncio.sleep(0.15)
            async with sess.get(url + "/flush_cache") as r:
                assert r.status == 400  # requests running
            assert (await post("/abort_request", {"rid": "victim"}))[0] == 200
            status, out = await task
            assert status == 200
            meta = out["meta_info"]
            assert meta["finish_reason"]["type"] == "abort"
            assert 0 < meta["completion_tokens"] < 200
            assert out["output_ids"] == expected_tokens([1, 2], 200)[: meta["completion_tokens"]]
            assert (await other)[1]["meta_info"]["finish_reason"]["type"] == "length"
            async with sess.get(url + "/flush_cache") as r:
                assert r.status == 200

            # in_place pause holds a request; continue finishes it unchanged
            task = asyncio.create_task(gen("held", n=20))
            await asyncio.sleep(0.05)
            status, text = await post("/pause_generation", {"mode": "in_place"})
            assert status == 200 and json.loads(text)["status"] == "ok"
            await asyncio.sleep(0.3)
            assert not task.done()
            status, text = await post("/continue_generation", {})
            assert status == 200 and json.loads(text)["message"] == "Generation continued successfully."
            status, out = await task
            assert out["output_ids"] == expected_tokens([1, 2], 20)

            # default (abort) pause: the in-flight request comes back aborted; a new one waits for continue
            task = asyncio.create_task(gen("paused", n=200))
            await asyncio.sleep(0.1)
            assert (await post("/pause_generation"))[0] == 200  # 0.5.5 style: no body
            status, out = await task
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            waiting = asyncio.create_task(gen("late", n=3))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            # aborted while waiting: SGLang's reduced meta_info
            assert (await post("/abort_request", {"abort_all": True}))[0] == 200
            status, out = await waiting
            assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
            assert "weight_version" not in out["meta_info"] and out["meta_info"]["completion_tokens"] == 0
            assert (await post("/pause_generation", {"mode": "bogus"}))[0] == 400
            assert (await post("/continue_generation", {}))[0] == 200
            assert (await gen("after", n=3))[1]["meta_info"]["finish_reason"]["type"] == "length"

    asyncio.run(run())


def test_text_prompts_and_trimmed_text_with_a_tokenizer():
    from engine_fakes import FakeEngine

    from ipa_jax.chat import build_tokenizer
    from ipa_jax.engines.devserver import DevServer

    tok = build_tokenizer(corpus=["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300)
    s = DevServer(FakeEngine(), tokenizer=tok).serve_in_thread()
    try:
        prompt = tok.encode("the fox", add_special_tokens=False)
        full = expected_tokens(prompt, 6)
        body = {
            "text": "the fox",
            "sampling_params": {"max_new_tokens": 6, "stop_token_ids": [full[3]], "skip_special_tokens": False},
        }
        status, out = http(s.url, "/generate", body)
        assert status == 200 and out["meta_info"]["prompt_tokens"] == len(prompt)
        cut = full.index(full[3]) + 1
        assert out["output_ids"] == full[:cut]
        # SGLang trims the matched stop token from `text` only, unless no_stop_trim
        assert out["text"] == tok.decode(full[: cut - 1])
        body["sampling_params"]["no_stop_trim"] = True
        assert http(s.url, "/generate", body)[1]["text"] == tok.decode(full[:cut])
        status, outs = http(s.url, "/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and [o["output_ids"] for o in outs] == [
            expected_tokens(tok.encode(t, add_special_tokens=False), 2) for t in ("a", "b")
        ]
    finally:
        s.shutdown()
