"""EmbeddedEngine against the model's own full forward pass (no cache) and token_logprobs.

Every call uses 3 prompts (padded to a batch of 4), prompts <= 16 tokens and prompt + max_new <= 32, with
routed experts on, so the whole module compiles one prefill and one decode loop.
"""

import asyncio
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import make_tiny_hf_checkpoint, tiny_qwen3_config

from ipa_jax.engines import SamplingParams, embedded
from ipa_jax.engines.base import PrefixCounts
from ipa_jax.engines.embedded import EmbeddedEngine
from ipa_jax.models import MeshConfig, from_pretrained, init_model, make_mesh, token_logprobs

PROMPTS = [[1, 5, 9], [2, 7, 11, 13, 17, 19, 23], [3, 4]]
WIDTH = 32  # reference forward width (right padding is invisible to causal attention)


def sp(max_new=20, **kw) -> SamplingParams:
    return SamplingParams(max_new, return_routed_experts=True, **kw)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("embedded")
    return make_tiny_hf_checkpoint(base / "a", seed=0), make_tiny_hf_checkpoint(base / "b", seed=1)


@pytest.fixture(scope="module")
def model(ckpts):
    return from_pretrained(ckpts[0])


@pytest.fixture(scope="module")
def engine(model, loop):
    eng = EmbeddedEngine(model, seed=0, max_len=64, max_batch=4, decode_chunk=8, batch_buckets=(4,))
    yield eng
    loop.run_until_complete(eng.close())


@pytest.fixture(scope="module")
def reference(model):
    """Jitted full forward (logits, routed experts) and token_logprobs on [3, WIDTH] right-padded rows."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, tokens):
        out = nnx.merge(graphdef, params)(tokens)
        return out.logits.astype(jnp.float32), out.aux["routed_experts"]

    @jax.jit
    def logprobs(params, tokens, mask):
        return token_logprobs(nnx.merge(graphdef, params), tokens, mask)[0]

    def pad(rows):
        tokens = np.zeros((len(rows), WIDTH), np.int32)
        mask = np.zeros((len(rows), WIDTH), bool)
        for i, r in enumerate(rows):
            tokens[i, : len(r)], mask[i, : len(r)] = r, True
        return jnp.asarray(tokens), jnp.asarray(mask)

    class Ref:
        def greedy(self, prompts, n, p=params):
            rows = [list(x) for x in prompts]
            for _ in range(n):
                logits, _ = forward(p, pad(rows)[0])
                for i, r in enumerate(rows):
                    r.append(int(jnp.argmax(logits[i, len(r) - 1])))
            return [r[len(x) :] for r, x in zip(rows, prompts)]

        def forward(self, rows):
            return forward(params, pad(rows)[0])

        def logprobs(self, rows):
            return np.asarray(logprobs(params, *pad(rows)))

    return Ref()


def test_greedy_equals_argmax_of_full_forward(engine, reference, loop):
    results = loop.run_until_complete(engine.generate(PROMPTS, sp(temperature=0.0)))
    want = reference.greedy(PROMPTS, 20)
    full = [p + r.token_ids for p, r in zip(PROMPTS, results)]
    lp = reference.logprobs(full)
    _, routed = reference.forward(full)
    for i, (p, r) in enumerate(zip(PROMPTS, results)):
        assert r.token_ids == want[i]
        assert r.finish_reason == "length" and r.weight_version == 0
        # greedy reports the model's log-prob of the chosen token
        np.testing.assert_allclose(r.logprobs, lp[i, len(p) : len(full[i])], atol=1e-5)
        # routed experts: row t = experts used when processing token t of prompt + output (last never fed)
        assert r.routed_experts.shape == (len(full[i]) - 1, 2, 2)
        np.testing.assert_array_equal(r.routed_experts, np.asarray(routed[i, : len(full[i]) - 1]))


def test_sampled_logprobs_equal_token_logprobs(engine, reference, loop):
    results = loop.run_until_complete(engine.generate(PROMPTS, sp(temperature=1.0)))
    full = [p + r.token_ids for p, r in zip(PROMPTS, results)]
    lp = reference.logprobs(full)
    for i, (p, r) in enumerate(zip(PROMPTS, results)):
        assert len(r.token_ids) == 20
        assert np.max(np.abs(np.array(r.logprobs) - lp[i, len(p) : len(full[i])])) < 1e-5
    assert len({tuple(r.token_ids) for r in results}) == 3


def test_seeded_requests_sample_alike_in_any_batch(engine, reference, loop):
    """A request with a sampling_seed draws the same tokens alone, beside other requests and in another row; another
    seed (the control) draws others. Its log-probs stay those of the full forward."""
    seeds = [11, 2**40 + 3, 7]
    params = [sp(temperature=1.0, sampling_seed=s) for s in seeds]
    together = loop.run_until_complete(engine.generate(PROMPTS, params))
    reordered = loop.run_until_complete(engine.generate(PROMPTS[::-1], params[::-1]))[::-1]
    alone = loop.run_until_complete(engine.generate(PROMPTS[1:2], params[1:2]))
    assert [r.token_ids for r in together] == [r.token_ids for r in reordered]
    assert alone[0].token_ids == together[1].token_ids
    full = [p + r.token_ids for p, r in zip(PROMPTS, together)]
    lp = reference.logprobs(full)
    for i, (p, r) in enumerate(zip(PROMPTS, together)):
        np.testing.assert_allclose(r.logprobs, lp[i, len(p) : len(full[i])], atol=1e-5)
    other = loop.run_until_complete(engine.generate(PROMPTS, [sp(temperature=1.0, sampling_seed=s + 1) for s in seeds]))
    assert all(o.token_ids != t.token_ids for o, t in zip(other, together))


def test_truncated_sampling_logprobs_are_of_the_sampled_distribution(engine, reference, loop):
    params = [sp(temperature=0.7, top_k=5), sp(temperature=1.3, top_p=0.6), sp(temperature=1.0, top_k=8, top_p=0.9)]
    results = loop.run_until_complete(engine.generate(PROMPTS, params))
    full = [p + r.token_ids for p, r in zip(PROMPTS, results)]
    logits, _ = reference.forward(full)
    logits = np.asarray(logits, np.float64)
    for i, (p, r, q) in enumerate(zip(PROMPTS, results, params)):
        for j, (tok, got) in enumerate(zip(r.token_ids, r.logprobs)):
            z = logits[i, len(p) + j - 1] / q.temperature
            probs = np.exp(z - z.max())
            probs /= probs.sum()
            order = np.argsort(-probs, kind="stable")
            k = q.top_k if q.top_k > 0 else len(probs)
            kept = order[:k]
            pk = probs[kept] / probs[kept].sum()
            before = np.cumsum(pk) - pk
            kept = kept[before < q.top_p]
            assert tok in kept
            want = np.log(probs[tok] / probs[kept].sum())
            assert abs(got - want) < 1e-5


def test_stop_tokens_and_max_new_tokens_per_row(engine, reference, loop):
    greedy = reference.greedy(PROMPTS, 20)
    stop = greedy[0][4]
    params = [
        sp(temperature=0.0, stop_token_ids=[stop]),
        sp(6, temperature=0.0),
        sp(temperature=0.0, stop_token_ids=[999]),
    ]
    r0, r1, r2 = loop.run_until_complete(engine.generate(PROMPTS, params))
    cut = greedy[0].index(stop) + 1
    assert r0.token_ids == greedy[0][:cut] and r0.finish_reason == "stop" and r0.matched_stop == stop
    assert len(r0.logprobs) == cut and r0.routed_experts.shape[0] == len(PROMPTS[0]) + cut - 1
    assert r1.token_ids == greedy[1][:6] and r1.finish_reason == "length" and r1.matched_stop is None
    assert r2.token_ids == greedy[2] and r2.finish_reason == "length"


class LetterTokenizer:
    """decode(ids) = one letter per id: enough for stop strings."""

    def decode(self, ids, **kw):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_strings(model, reference, loop):
    greedy = reference.greedy(PROMPTS, 20)
    text = LetterTokenizer().decode(greedy[1])
    stop = text[7:9]
    eng = EmbeddedEngine(
        model, max_len=64, max_batch=4, decode_chunk=8, batch_buckets=(4,), tokenizer=LetterTokenizer()
    )
    try:
        params = [sp(temperature=0.0), sp(temperature=0.0, stop=[stop]), sp(temperature=0.0)]
        _, r, _ = loop.run_until_complete(eng.generate(PROMPTS, params))
    finally:
        loop.run_until_complete(eng.close())
    cut = text.index(stop) + len(stop)
    assert r.finish_reason == "stop" and r.matched_stop == stop
    assert r.token_ids == greedy[1][:cut]


def test_weight_update_from_disk_and_from_learner(engine, model, ckpts, reference, loop):
    base = reference.greedy(PROMPTS, 20)
    loop.run_until_complete(engine.update_weights(ckpts[1], 1))
    try:
        new = loop.run_until_complete(engine.generate(PROMPTS, sp(temperature=0.0)))
        assert engine.weight_version == 1 and all(r.weight_version == 1 for r in new)
        other = from_pretrained(ckpts[1])
        assert [r.token_ids for r in new] == reference.greedy(PROMPTS, 20, p=nnx.state(other))
        assert [r.token_ids for r in new] != base
    finally:
        learner = from_pretrained(ckpts[0])
        engine.set_params_from_model(learner, 2)
        for leaf in jax.tree.leaves(nnx.state(learner)):
            leaf.delete()  # as a train step that donates its state would: the engine holds its own copy
    back = loop.run_until_complete(engine.generate(PROMPTS, sp(temperature=0.0)))
    assert [r.token_ids for r in back] == base and back[0].weight_version == 2
    dense = init_model(tiny_qwen3_config(moe=False))
    with pytest.raises(ValueError, match="parameter tree"):
        engine.set_params_from_model(dense, 3)
    assert engine.weight_version == 2


def test_weight_update_from_disk_keeps_the_engines_paths_and_sharding(ckpts, loop):
    """An engine whose model computes with other than the default paths (learner-side config fields) and lives on a
    mesh takes a checkpoint of the same architecture into the same paths and shardings."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=2), devices=jax.devices()[:2])
    model = from_pretrained(ckpts[0], mesh=mesh, moe_impl="dense", attention_impl="reference")
    eng = EmbeddedEngine(model, max_len=64, max_batch=4)
    try:
        loop.run_until_complete(eng.update_weights(ckpts[1], 1))
        assert eng.weight_version == 1
        want = nnx.state(from_pretrained(ckpts[1], mesh=mesh))
        for (path, got), (_, ref) in zip(nnx.to_flat_state(eng._current[0]), nnx.to_flat_state(want)):
            np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(ref[...]), err_msg=str(path))
            assert got[...].sharding == ref[...].sharding, path
        with pytest.raises(ValueError, match="different architecture"):
            other = make_tiny_hf_checkpoint(os.path.join(os.path.dirname(ckpts[0]), "dense"), seed=2, moe=False)
            loop.run_until_complete(eng.update_weights(other, 2))
        assert eng.weight_version == 1
    finally:
        loop.run_until_complete(eng.close())


def test_pushed_weights_are_own_copies_in_the_engines_placement(ckpts, reference, loop):
    """push_weights from a learner on all 8 devices (replicated parameters) into an engine on 4 of them, and from
    host arrays (what process 0 gathers on several processes): the engine keeps its placement and samples as the
    pushed weights do, also once the learner's buffers are donated (device_put alone would share them)."""
    everywhere = make_mesh(MeshConfig(data=-1, fsdp=1))
    four = make_mesh(MeshConfig(data=-1, fsdp=1), devices=jax.devices()[:4])
    eng = EmbeddedEngine(from_pretrained(ckpts[0], mesh=four), max_len=64, max_batch=4)
    placement = [x.sharding for x in jax.tree.leaves(eng._current[0])]
    try:
        learner = from_pretrained(ckpts[1], mesh=everywhere)
        loop.run_until_complete(eng.push_weights(learner, 1))
        for leaf in jax.tree.leaves(nnx.state(learner)):
            leaf.delete()  # the learner's next step donates them
        new = loop.run_until_complete(eng.generate(PROMPTS, sp(temperature=0.0)))
        assert [r.token_ids for r in new] == reference.greedy(PROMPTS, 20, p=nnx.state(from_pretrained(ckpts[1])))
        host = nnx.merge(*nnx.split(from_pretrained(ckpts[0])))
        host = nnx.merge(nnx.graphdef(host), jax.device_get(nnx.state(host)))
        loop.run_until_complete(eng.push_weights(host, 2))
        back = loop.run_until_complete(eng.generate(PROMPTS, sp(temperature=0.0)))
        assert [r.token_ids for r in back] == reference.greedy(PROMPTS, 20) and back[0].weight_version == 2
        assert [x.sharding for x in jax.tree.leaves(eng._current[0])] == placement
    finally:
        loop.run_until_complete(eng.close())


def test_pause_holds_and_abort_returns_partial(engine, reference, loop):
    greedy = reference.greedy(PROMPTS, 20)

    async def go():
        await engine.pause()
        task = asyncio.ensure_future(engine.generate(PROMPTS, sp(temperature=0.0), request_ids=["a-0", "a-1", "b-2"]))
        await asyncio.sleep(0.3)
        assert not task.done() and not engine._running  # paused: the batch does not start
        await engine.resume()
        while not engine._running:
            await asyncio.sleep(0.001)
        await engine.pause()  # held in place at a chunk boundary
        await engine.abort(["a-"])
        await asyncio.sleep(0.2)
        assert not task.done()  # b-2 is still held
        await engine.resume()
        return await task

    r0, r1, r2 = loop.run_until_complete(go())
    for r, g in ((r0, greedy[0]), (r1, greedy[1])):
        assert r.finish_reason == "abort" and 1 <= len(r.token_ids) < 20 and r.token_ids == g[: len(r.token_ids)]
    assert r2.finish_reason == "length" and r2.token_ids == greedy[2]


class GateTokenizer(LetterTokenizer):
    """Blocks the engine's first stop-string check (host side, right after the batch's prefill) until released."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def decode(self, ids, **kw):
        self.entered.set()
        self.release.wait(30)
        return super().decode(ids)


def test_finished_rows_take_queued_requests(model, reference, loop):
    """Continuous batching: a request queued while a batch runs is admitted into a free row at a chunk boundary
    and returns before the long requests do, with the same tokens as alone."""
    greedy = reference.greedy(PROMPTS, 20)
    gate = GateTokenizer()
    eng = EmbeddedEngine(model, max_len=64, max_batch=4, decode_chunk=8, batch_buckets=(4,), tokenizer=gate)

    async def go():
        order = []
        params = [sp(temperature=0.0), sp(temperature=0.0), sp(temperature=0.0, stop=["never matched"])]
        long = asyncio.ensure_future(eng.generate(PROMPTS, params))
        long.add_done_callback(lambda _: order.append("long"))
        await asyncio.to_thread(gate.entered.wait, 30)  # the batch is prefilled, no decode step yet
        short = asyncio.ensure_future(eng.generate([[3, 4]], sp(2, temperature=0.0)))
        short.add_done_callback(lambda _: order.append("short"))
        await asyncio.sleep(0.01)  # queued
        gate.release.set()
        (s,), longs = await short, await long
        return order, s, longs

    try:
        order, s, longs = loop.run_until_complete(go())
    finally:
        loop.run_until_complete(eng.close())
    assert order == ["short", "long"] and eng.num_batches == 2  # one batch prefill + one admission
    assert s.token_ids == greedy[2][:2] and s.finish_reason == "length"
    assert [r.token_ids for r in longs] == greedy


def test_kv_cache_grows_with_the_rows(model, reference, loop, monkeypatch):
    """The cache starts at MIN_CACHE_SLOTS slots (8 here) and doubles before an admission (a 12-token prompt: 16)
    or a decode chunk (32 after 20 tokens) would write past them: tokens and log-probs equal the full forward."""
    monkeypatch.setattr(embedded, "MIN_CACHE_SLOTS", 8)
    extended, extend = [], embedded.extend_kv_cache
    monkeypatch.setattr(embedded, "extend_kv_cache", lambda cache, n: extended.append(n) or extend(cache, n))
    prompts = [PROMPTS[0], list(range(1, 13)), PROMPTS[2]]
    eng = EmbeddedEngine(model, max_len=64, max_batch=4, decode_chunk=8, batch_buckets=(4,))
    try:
        results = loop.run_until_complete(eng.generate(prompts, sp(20, temperature=0.0)))
    finally:
        loop.run_until_complete(eng.close())
    assert extended == [16, 32]  # the longest row writes up to position 12 + 19 - 1 = 30
    assert [r.token_ids for r in results] == reference.greedy(prompts, 20)
    full = [p + r.token_ids for p, r in zip(prompts, results)]
    lp = reference.logprobs(full)
    for i, (p, r) in enumerate(zip(prompts, results)):
        np.testing.assert_allclose(r.logprobs, lp[i, len(p) : len(full[i])], atol=1e-5)


def test_prefix_cache_prefills_only_a_turns_new_tokens(model, ckpts, reference, loop):
    """A multi-turn episode's second turn (its first turn's prompt and output, then new tokens) reuses the row its
    first turn left: only the new tokens are prefilled, and tokens, log-probs and routed experts equal the full
    forward pass. Once other weights are served (even under the same version number) nothing is reused;
    prefix_cache=False never reuses."""
    eng = EmbeddedEngine(model, max_len=64, max_batch=4, decode_chunk=8, batch_buckets=(4,))
    off = EmbeddedEngine(model, max_len=64, max_batch=4, decode_chunk=8, batch_buckets=(4,), prefix_cache=False)
    other = from_pretrained(ckpts[1])
    try:
        first = loop.run_until_complete(eng.generate(PROMPTS, sp(6, temperature=0.0)))
        assert eng.prefix_counts() == PrefixCounts(sum(map(len, PROMPTS)), 0)
        second = [p + r.token_ids + [5, 6] for p, r in zip(PROMPTS, first)]
        results = loop.run_until_complete(eng.generate(second, sp(8, temperature=0.0)))
        # each row's cache: its prompt and the 5 output tokens it fed (the 6th was sampled, never fed)
        assert eng.prefix_counts() == PrefixCounts(
            sum(map(len, PROMPTS)) + 3 * (1 + 2), sum(len(p) + 5 for p in PROMPTS)
        )
        assert [r.cached_tokens for r in results] == [len(p) + 5 for p in PROMPTS]
        full = [c + r.token_ids for c, r in zip(second, results)]
        lp = reference.logprobs(full)
        _, routed = reference.forward(full)
        assert [r.token_ids for r in results] == reference.greedy(second, 8)
        for i, (c, r) in enumerate(zip(second, results)):
            np.testing.assert_allclose(r.logprobs, lp[i, len(c) : len(full[i])], atol=1e-5)
            np.testing.assert_array_equal(r.routed_experts, np.asarray(routed[i, : len(full[i]) - 1]))
        eng.set_params_from_model(other, 0)
        reused = eng.prefix_counts().reused
        again = loop.run_until_complete(eng.generate(second, sp(8, temperature=0.0)))
        assert eng.prefix_counts().reused == reused and not any(r.cached_tokens for r in again)
        assert [r.token_ids for r in again] == reference.greedy(second, 8, p=nnx.state(other))
        for prompts in (PROMPTS, second):
            loop.run_until_complete(off.generate(prompts, sp(8, temperature=0.0)))
        assert off.prefix_counts().reused == 0
    finally:
        loop.run_until_complete(eng.close())
        loop.run_until_complete(off.close())


def test_request_validation(engine, loop):
    with pytest.raises(ValueError, match="max_len"):
        loop.run_until_complete(engine.generate([[1] * 60], SamplingParams(10)))
    with pytest.raises(ValueError, match="vocab_size"):
        loop.run_until_complete(engine.generate([[1, 500]], SamplingParams(2)))
    with pytest.raises(ValueError, match="tokenizer"):
        loop.run_until_complete(engine.generate([[1]], SamplingParams(2, stop=["x"])))
    with pytest.raises(ValueError, match="prompts\\[0\\] is empty"):
        loop.run_until_complete(engine.generate([[]], SamplingParams(2)))
    (r,) = loop.run_until_complete(engine.generate([[1]], SamplingParams(0)))
    assert r.token_ids == [] and r.finish_reason == "length"
    for seed in (-1, 2**63, 1.5, True):
        with pytest.raises(ValueError, match="sampling_seed"):
            SamplingParams(2, sampling_seed=seed)
