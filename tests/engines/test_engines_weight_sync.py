"""Weight sync without a checkpoint: SGLang's distributed update (a named gloo group, bucketed broadcasts) from
SGLangEngine to dev servers running the embedded engine in their own processes, over real HTTP; values are read
back with /get_weights_by_name and compared with the arrays sent, cast as sent."""

import asyncio
import json
import time
import urllib.error
import urllib.request

import jax
import ml_dtypes
import numpy as np
import pytest
from server_process import ServerProcess, devserver_argv
from tiny_models import tiny_qwen3_config

from ipa_jax.engines import EngineError, SamplingParams, SGLangEngine
from ipa_jax.engines.weight_transfer import buckets, to_numpy, to_torch
from ipa_jax.models import init_model, save_pretrained
from ipa_jax.models.hf_io import hf_tensors, iter_hf_tensors, merge_hf_tensors

pytest.importorskip("torch")

CONFIG = tiny_qwen3_config(moe=True)
CONTROL_TIMEOUT_S = 10.0  # the gloo group's timeout too
FAST = dict(
    backoff_s=0.05,
    max_backoff_s=0.2,
    probe_interval_s=0.2,
    down_after_failures=1,
    control_timeout_s=CONTROL_TIMEOUT_S,
    outage_budget_s=60.0,
)


def http(url: str, path: str, body=None, timeout_s: float = 30.0):
    req = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        text = resp.read()
        return json.loads(text) if text else None


def bf16(x) -> np.ndarray:
    """What the server holds of an array sent in bfloat16, as float32."""
    return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)


# ---------------------------------------------------------------------------------------------- in-process parts
def test_buckets_keep_order_and_the_byte_budget():
    arrays = [(f"t{i}", np.zeros(n, np.float32)) for i, n in enumerate([3, 5, 2, 9, 1])]
    got = list(buckets(arrays, bucket_bytes=16, dtype="bfloat16"))  # 2 bytes per value: 8 values a bucket
    assert [b.names for b in got] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]  # t3 (18 bytes) goes alone
    assert [b.nbytes for b in got] == [16, 4, 18, 2]
    assert got[0].request("g") == {
        "names": ["t0", "t1"],
        "dtypes": ["bfloat16"] * 2,
        "shapes": [[3], [5]],
        "group_name": "g",
    }
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(buckets(arrays, bucket_bytes=0, dtype="bfloat16"))


def test_to_torch_shares_memory_where_it_can_and_casts_like_numpy():
    host = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    same = to_torch(host, "float32")
    assert same.data_ptr() == host.ctypes.data  # no copy
    device = jax.numpy.asarray(host)
    shared = to_torch(device, "float32")
    assert shared.data_ptr() == device.unsafe_buffer_pointer()  # DLPack: no copy
    for array in (host, device):
        got = to_numpy(to_torch(array, "bfloat16"))
        assert got.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got.astype(np.float32), bf16(host))


def test_merge_takes_complete_parameters_only():
    a, b = init_model(CONFIG, seed=0), init_model(CONFIG, seed=1)
    state, want = jax.tree.map(lambda x: x, _params(a)), hf_tensors(b)
    expert = "model.layers.0.mlp.experts.0.up_proj.weight"  # one of 4 experts: the parameter stays a's
    given = {k: v for k, v in want.items() if ".experts." not in k or k == expert}
    merged, used = merge_hf_tensors(state, given)
    assert used == set(given) - {expert}
    model = _with_params(a, merged)
    got, old = hf_tensors(model), hf_tensors(a)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name] if ".experts." not in name else old[name], err_msg=name)
    with pytest.raises(ValueError, match="not tensors of the model"):
        merge_hf_tensors(state, {"model.layers.9.nope.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="shape"):
        merge_hf_tensors(state, {"model.norm.weight": np.zeros(5, np.float32)})


def _params(model):
    from flax import nnx

    return nnx.split(model)[1]


def _with_params(model, state):
    from flax import nnx

    return nnx.merge(nnx.split(model)[0], state)


# ---------------------------------------------------------------------------------------------- over HTTP
class DevServerProcess(ServerProcess):
    """The dev server on a tiny checkpoint in its own process (SIGKILL, restart), its weights read over HTTP."""

    def __init__(self, model_path: str):
        super().__init__(
            devserver_argv(model_path, max_len=32, max_batch=2, batch_buckets=2, dist_timeout=CONTROL_TIMEOUT_S),
            start_timeout_s=120.0,
        )

    def version(self) -> int:
        return int(http(self.url, "/get_model_info")["weight_version"])

    def weights(self, name: str) -> np.ndarray:
        return np.array(http(self.url, "/get_weights_by_name", {"name": name, "truncate_size": 10_000}))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("weight_sync") / "v0")
    save_pretrained(init_model(CONFIG, seed=0), path)
    started = [DevServerProcess(path), DevServerProcess(path)]
    yield started
    for s in started:
        s.kill()


def assert_serves(server: DevServerProcess, tensors: dict[str, np.ndarray], version: int) -> None:
    assert server.version() == version
    for name, value in tensors.items():
        np.testing.assert_array_equal(server.weights(name), bf16(value), err_msg=f"{server.url} {name}")


def acting_once_at(tensors, index: int, done: list, act):
    """`tensors` as they come, `act()` called just before the one at `index` unless `done` already names one (then
    that tensor's name is added to it): a fault injected mid-transfer once, whichever call of the source it is."""
    for i, (name, value) in enumerate(tensors):
        if i == index and not done:
            act()
            done.append(name)
        yield name, value


def run(coro, timeout_s: float = 240.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.mark.slow
def test_distributed_sync_then_a_server_killed_mid_transfer(servers):
    """Two syncs over one group: every tensor read back equals the one sent (in bfloat16) and generations carry the
    new version. In the third sync one server is SIGKILLed after the first bucket: it is marked down, the transfer
    restarts on the other, which serves the new weights; no step waits for a timeout. Restarted (on its checkpoint,
    version 0), the killed server is resynced from the same tensors before it takes requests."""
    first, victim = servers
    v1, v2 = hf_tensors(init_model(CONFIG, seed=1)), init_model(CONFIG, seed=2)
    v2_tensors = hf_tensors(v2)
    bucket_bytes = 8192
    sizes = [len(b.names) for b in buckets(iter_hf_tensors(v2), bucket_bytes, "bfloat16")]
    assert len(sizes) >= 4
    killed = []

    def v2_killing_the_victim_once():
        """v2's tensors; the first call kills the victim once the first bucket was broadcast, before the second is
        posted: buckets are built one ahead, so the second is posted after the first tensor of the fourth is read."""
        yield from acting_once_at(iter_hf_tensors(v2, on_host=False), sum(sizes[:3]), killed, victim.kill)

    async def go():
        eng = SGLangEngine([s.url for s in servers], **FAST)
        try:
            await eng.update_weights_from_tensors(v1, 1)
            await eng.update_weights_from_tensors(v1, 2)  # the same group again
            group = eng._group.name
            results = await eng.generate([[1, 2, 3], [4, 5]] * 2, SamplingParams(4))
            assert {r.weight_version for r in results} == {2} and all(len(r.token_ids) == 4 for r in results)
            for s in servers:
                assert_serves(s, v1, 2)

            t0 = time.monotonic()
            await eng.update_weights_from_tensors(v2_killing_the_victim_once, 3, bucket_bytes=bucket_bytes)
            assert time.monotonic() - t0 < CONTROL_TIMEOUT_S and killed
            assert eng.weight_version == 3 and eng.servers[1].down and not eng.servers[0].down
            assert eng._group.name != group and eng._group.urls == (first.url,)
            assert_serves(first, v2_tensors, 3)

            await asyncio.to_thread(victim.start)
            assert victim.version() == 0
            while eng.servers[1].down:
                await asyncio.sleep(0.1)
            assert_serves(victim, v2_tensors, 3)
            results = await eng.generate([[7, 8, 9]] * 8, SamplingParams(3))
            assert {r.weight_version for r in results} == {3} and eng.servers[1].served > 0
        finally:
            await eng.close()

    run(go())


@pytest.mark.slow
def test_a_server_hung_mid_transfer_costs_one_control_timeout(servers):
    """A server SIGSTOPped after the first bucket: its call times out after control_timeout_s, it is marked down and
    the transfer restarts on the other; nothing waits for the group's own timeout twice. Resumed (SIGCONT), it is
    resynced before it takes requests."""
    healthy, hung = servers
    v1, v2 = init_model(CONFIG, seed=3), init_model(CONFIG, seed=4)
    v2_tensors = hf_tensors(v2)
    bucket_bytes = 8192
    sizes = [len(b.names) for b in buckets(iter_hf_tensors(v2), bucket_bytes, "bfloat16")]
    stopped = []

    def v2_hanging_a_server_once():
        yield from acting_once_at(iter_hf_tensors(v2), sum(sizes[:3]), stopped, hung.hang)  # as in the test above

    async def go():
        eng = SGLangEngine([s.url for s in servers], **FAST)
        try:
            await eng.update_weights_from_tensors(lambda: iter_hf_tensors(v1), 1)
            t0 = time.monotonic()
            await eng.update_weights_from_tensors(v2_hanging_a_server_once, 2, bucket_bytes=bucket_bytes)
            assert stopped and time.monotonic() - t0 < 2 * CONTROL_TIMEOUT_S
            assert eng.weight_version == 2 and eng.servers[1].down and not eng.servers[0].down
            assert_serves(healthy, v2_tensors, 2)
            hung.resume()
            while eng.servers[1].down:
                await asyncio.sleep(0.1)
            assert_serves(hung, v2_tensors, 2)
        finally:
            hung.resume()
            await eng.close()

    run(go())


def test_servers_that_cannot_take_tensors_fail_the_sync_at_once(fake_server):
    """A dev server whose engine cannot load tensors answers the group's init with a 400: the sync raises at once
    (waiting would not help) and the server is marked down; its probe resumes it (it is not left paused)."""
    server = fake_server()

    async def go():
        eng = SGLangEngine([server.url], **FAST)
        try:
            with pytest.raises(EngineError, match="cannot load tensors"):
                await eng.update_weights_from_tensors({"model.norm.weight": np.ones(4, np.float32)}, 1)
            assert eng.weight_version == 0 and eng.servers[0].down
            assert http(server.url, "/get_model_info")["weight_version"] == "0"
            while eng.servers[0].down:
                await asyncio.sleep(0.1)
            assert http(
                server.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout_s=5
            )["output_ids"]  # continued, not left paused
        finally:
            await eng.close()

    run(go(), timeout_s=60)


@pytest.mark.slow
def test_push_weights_with_distributed_sync_sends_a_host_copy_and_writes_no_folder(servers, tmp_path):
    """`weight_sync="distributed"` behind the Engine interface (what the online loop calls): every server serves the
    model's tensors in bfloat16 under the new version, from a host copy (the model's buffers are deleted right after
    the push, as the learner's next step donates them), and nothing is written to the weights folder."""
    model = init_model(CONFIG, seed=5)
    expected = hf_tensors(model)

    async def go():
        eng = SGLangEngine(
            [s.url for s in servers], weights_dir=str(tmp_path / "weights"), weight_sync="distributed", **FAST
        )
        try:
            while any(s.down for s in eng.servers):  # the previous test's restarted server, until its probe is back
                await asyncio.sleep(0.1)
            await eng.push_weights(model, 11)
            for leaf in jax.tree.leaves(_params(model)):
                leaf.delete()
            assert eng.weight_version == 11
            for s in servers:
                assert_serves(s, expected, 11)
        finally:
            await eng.close()

    run(go())
    assert not (tmp_path / "weights").exists()
    with pytest.raises(ValueError, match="weight_sync"):
        SGLangEngine([servers[0].url], weight_sync="nfs")
