"""Partial rollouts across a weight update with the embedded engine: the dev server's pause/abort/update/continue
contract over real HTTP, the SGLang client in both `partial` modes on it, and the engine in process.

A generation is stopped mid-way deterministically: the engine's tokenizer (used for a stop string that never
matches) blocks its second stop-string check, after the prefill and one decode chunk (1 + DECODE_CHUNK tokens), until
the test has set the update up. Tokens are greedy and every log-prob is checked against transformers' forward of
the checkpoint that should have sampled it: the prefix against the old weights, the continuation against the new.
"""

import asyncio
import functools
import json
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch
import transformers
from tiny_models import make_tiny_hf_checkpoint

from ipa_jax.engines import SamplingParams, SGLangEngine
from ipa_jax.engines.devserver import DevServer
from ipa_jax.engines.embedded import EmbeddedEngine
from ipa_jax.models import from_pretrained

PROMPT = [1, 5, 9]
MAX_NEW = 24
DECODE_CHUNK = 4
SPLIT = 1 + DECODE_CHUNK  # tokens generated when the second check blocks: the prefill's and one chunk's
NEVER = "!"  # a stop string GateTokenizer never decodes to
GREEDY = SamplingParams(MAX_NEW, temperature=0.0, stop=(NEVER,))


class GateTokenizer:
    """decode(ids) = one letter per id; the second call blocks until `release` is set (`entered` says it is
    blocked)."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0

    def decode(self, ids, **kw):
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            assert self.release.wait(60), "the test never released the engine"
        return "".join(chr(97 + t % 26) for t in ids)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("partial")
    return make_tiny_hf_checkpoint(base / "old", moe=False, seed=0), make_tiny_hf_checkpoint(
        base / "new", moe=False, seed=1
    )


@functools.cache
def hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def hf_logprobs(path: str, tokens: list[int]) -> np.ndarray:
    """[len(tokens)]: position t = log p(tokens[t] | tokens[:t]) under the checkpoint (0 at position 0)."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([tokens])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return np.concatenate([[0.0], lp.numpy()])


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(hf_model(path)(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def check_split(ckpts, tokens: list[int], logprobs: list[float], split: int) -> None:
    """tokens[:split] are the old checkpoint's greedy continuation of PROMPT, the rest the new one's greedy
    continuation of PROMPT + that prefix; each part's log-probs are its checkpoint's."""
    old, new = ckpts
    full = PROMPT + tokens
    assert len(tokens) == MAX_NEW
    assert tokens[:split] == hf_greedy(old, PROMPT, split)
    assert tokens[split:] == hf_greedy(new, PROMPT + tokens[:split], MAX_NEW - split)
    got = np.asarray(logprobs)
    on_old, on_new = hf_logprobs(old, full)[len(PROMPT) :], hf_logprobs(new, full)[len(PROMPT) :]
    np.testing.assert_allclose(got[:split], on_old[:split], atol=1e-4)
    np.testing.assert_allclose(got[split:], on_new[split:], atol=1e-4)
    assert np.abs(on_old - on_new).min() > 1e-3  # each token's log-prob tells the two checkpoints apart


def engine(path: str, gate: GateTokenizer, partial: str = "finish") -> EmbeddedEngine:
    return EmbeddedEngine(
        from_pretrained(path),
        max_len=64,
        max_batch=4,
        batch_buckets=(4,),
        decode_chunk=DECODE_CHUNK,
        tokenizer=gate,
        partial=partial,
    )


async def release_once_aborted(eng: EmbeddedEngine, gate: GateTokenizer) -> None:
    """Release the blocked engine once its running request is marked aborted (a pause in abort mode)."""
    deadline = time.monotonic() + 60
    while not (eng._running and all(r.aborted for r in eng._running)):
        assert time.monotonic() < deadline, "the request was never aborted"
        await asyncio.sleep(0.01)
    gate.release.set()


def http(url: str, path: str, body=None) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        text = resp.read().decode()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


def test_devserver_pause_abort_update_continue_round_trip(ckpts):
    """SGLang's contract by hand: an aborted request returns its tokens so far (finish_reason abort, their log-probs
    and version); resubmitted as prompt + those tokens after the update, it continues on the new weights."""
    gate = GateTokenizer()
    server = DevServer(engine(ckpts[0], gate), model_path=ckpts[0]).serve_in_thread()
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "stop": [NEVER]}

    async def go():
        long = asyncio.create_task(
            asyncio.to_thread(
                http,
                server.url,
                "/generate",
                {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True, "rid": "long"},
            )
        )
        await asyncio.to_thread(gate.entered.wait, 60)
        pause = asyncio.create_task(asyncio.to_thread(http, server.url, "/pause_generation", {"mode": "abort"}))
        await release_once_aborted(server.engine, gate)
        assert (await pause)[0] == 200
        status, first = await long
        assert status == 200
        status, update = await asyncio.to_thread(
            http, server.url, "/update_weights_from_disk", {"model_path": ckpts[1], "weight_version": "1"}
        )
        assert status == 200 and update["success"] is True
        assert (await asyncio.to_thread(http, server.url, "/continue_generation", {}))[0] == 200
        prefix = [x[1] for x in first["meta_info"]["output_token_logprobs"]]
        rest = {**sampling, "max_new_tokens": MAX_NEW - len(prefix)}
        status, second = await asyncio.to_thread(
            http,
            server.url,
            "/generate",
            {"input_ids": PROMPT + prefix, "sampling_params": rest, "return_logprob": True, "rid": "long-1"},
        )
        assert status == 200
        return first, second

    try:
        first, second = asyncio.run(asyncio.wait_for(go(), 300))
    finally:
        server.shutdown()
    meta = first["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["weight_version"] == "0"
    assert meta["completion_tokens"] == SPLIT == len(first["output_ids"])
    meta2 = second["meta_info"]
    assert meta2["finish_reason"]["type"] == "length" and meta2["weight_version"] == "1"
    pairs = meta["output_token_logprobs"] + meta2["output_token_logprobs"]
    check_split(ckpts, [x[1] for x in pairs], [x[0] for x in pairs], SPLIT)


@pytest.mark.parametrize("partial", ["finish", "abort_resume"])
def test_sglang_client_weight_sync_with_a_request_in_flight(ckpts, partial):
    """finish: the sync waits for the request, which ends on the old weights. abort_resume: the sync's pause
    interrupts it and the client continues it on the new weights; each token carries the version that sampled it."""
    gate = GateTokenizer()
    server = DevServer(engine(ckpts[0], gate), model_path=ckpts[0]).serve_in_thread()

    async def go():
        eng = SGLangEngine([server.url], partial=partial, backoff_s=0.05)
        try:
            task = asyncio.create_task(eng.generate([PROMPT], GREEDY, request_ids=["episode"]))
            await asyncio.to_thread(gate.entered.wait, 60)
            sync = asyncio.create_task(eng.update_weights(ckpts[1], 1))
            if partial == "finish":
                await asyncio.sleep(0.2)
                assert not sync.done()  # cannot be: it waits for the request, which the gate holds
                gate.release.set()
            else:
                await release_once_aborted(server.engine, gate)
            await sync
            (result,) = await task
            return result, eng.partial_counts()
        finally:
            await eng.close()

    try:
        result, counts = asyncio.run(asyncio.wait_for(go(), 300))
    finally:
        server.shutdown()
    assert result.finish_reason == "length" and counts.updates == 1
    if partial == "finish":
        assert result.weight_version == 0 and result.token_versions == [0] * MAX_NEW
        assert counts.interrupted == counts.resumed == 0
        check_split(ckpts, result.token_ids, result.logprobs, MAX_NEW)
    else:
        assert result.weight_version == 1 and result.token_versions == [0] * SPLIT + [1] * (MAX_NEW - SPLIT)
        assert counts.interrupted == counts.resumed == 1
        check_split(ckpts, result.token_ids, result.logprobs, SPLIT)


def test_embedded_abort_resume_stops_the_batch_and_continues_on_the_new_weights(ckpts):
    gate = GateTokenizer()
    eng = engine(ckpts[0], gate, partial="abort_resume")

    async def go():
        task = asyncio.create_task(eng.generate([PROMPT], GREEDY))
        await asyncio.to_thread(gate.entered.wait, 60)
        eng.set_params_from_model(from_pretrained(ckpts[1]), 1)  # staged: a batch is running
        assert eng.weight_version == 0
        gate.release.set()
        (result,) = await task
        return result

    try:
        result = asyncio.run(asyncio.wait_for(go(), 300))
    finally:
        asyncio.run(eng.close())
    assert result.finish_reason == "length" and result.weight_version == eng.weight_version == 1
    assert result.token_versions == [0] * SPLIT + [1] * (MAX_NEW - SPLIT)
    counts = eng.partial_counts()
    assert counts.updates == counts.interrupted == counts.resumed == 1
    check_split(ckpts, result.token_ids, result.logprobs, SPLIT)


def test_embedded_finish_ends_running_requests_on_the_old_weights_first(ckpts):
    """The update waits for the running request; a request arriving meanwhile starts on the new weights."""
    gate = GateTokenizer()
    eng = engine(ckpts[0], gate)

    async def go():
        running = asyncio.create_task(eng.generate([PROMPT], GREEDY))
        await asyncio.to_thread(gate.entered.wait, 60)
        eng.set_params_from_model(from_pretrained(ckpts[1]), 1)
        arriving = asyncio.create_task(eng.generate([PROMPT], GREEDY))
        await asyncio.sleep(0.05)  # queued behind the staged weights
        gate.release.set()
        return (await running)[0], (await arriving)[0]

    try:
        old, new = asyncio.run(asyncio.wait_for(go(), 300))
    finally:
        asyncio.run(eng.close())
    assert old.weight_version == 0 and old.token_versions == [0] * MAX_NEW
    check_split(ckpts, old.token_ids, old.logprobs, MAX_NEW)
    assert new.weight_version == 1 and new.token_versions == [1] * MAX_NEW
    assert new.token_ids == hf_greedy(ckpts[1], PROMPT, MAX_NEW)
    counts = eng.partial_counts()
    assert counts.updates == 1 and counts.interrupted == counts.resumed == 0


def test_partial_mode_is_validated():
    with pytest.raises(ValueError, match="partial must be one of"):
        SGLangEngine(["http://127.0.0.1:1"], partial="resume")
