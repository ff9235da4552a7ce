"""Weight sync without a checkpoint: SGLang's distributed update (a named gloo group, bucketed broadcasts) from
SGLangEngine to dev servers running the embedded engine in their own processes, over real HTTP; values are read
back with /get_weights_by_name and compared with the arrays sent, cast as sent. The pool mixes releases: the first
server behaves like SGLang 0.5.23 (updates only inside a weight-update session), the second like 0.5.20 (no
session)."""

import asyncio
import time
import uuid

import jax
import ml_dtypes
import numpy as np
import pytest
from server_process import ServerProcess, devserver_argv, http
from tiny_models import tiny_qwen3_config

from ipa_jax.engines import EngineError, SamplingParams, SGLangEngine
from ipa_jax.engines.devserver import OUTSIDE_SESSION
from ipa_jax.engines.sglang import NO_SESSION_OPEN
from ipa_jax.engines.weight_transfer import WeightSender, buckets, host_store, in_daemon_thread, to_numpy, to_torch
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

    def __init__(self, model_path: str, **flags):
        super().__init__(
            devserver_argv(
                model_path, max_len=32, max_batch=2, batch_buckets=2, dist_timeout=CONTROL_TIMEOUT_S, **flags
            ),
            start_timeout_s=120.0,
        )

    def version(self) -> str:
        return http(self.url, "/model_info")[1]["weight_version"]

    def weights(self, name: str) -> np.ndarray:
        return np.array(http(self.url, "/get_weights_by_name", {"name": name, "truncate_size": 10_000})[1])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("weight_sync") / "v0")
    save_pretrained(init_model(CONFIG, seed=0), path)
    started = [DevServerProcess(path), DevServerProcess(path, sglang_version="0.5.20")]
    yield started
    for s in started:
        s.kill()


def assert_serves(server: DevServerProcess, tensors: dict[str, np.ndarray], version: int) -> None:
    assert server.version() == str(version)
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
            assert victim.version() == "0"
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


def test_an_update_outside_a_session_is_refused_as_sglang_does_without_holding_up_the_broadcast(servers):
    """The 0.5.23 dev server refuses an update outside a weight-update session with SGLang's answer, but receives
    the broadcast first: the trainer's rank 0 completes it (it would otherwise wait out its group's timeout and
    fail). Inside a session the same update is taken, with a free-form version. The 0.5.20 one has no session."""
    current, legacy = servers
    assert [http(s.url, "/server_info")[1]["version"] for s in servers] == ["0.5.23", "0.5.20"]
    assert http(legacy.url, "/begin_weight_update", {})[0] == 404
    name = "model.norm.weight"
    value = np.linspace(-1, 1, CONFIG.hidden_size, dtype=np.float32)
    bucket = next(buckets([(name, value)], 1 << 20, "bfloat16"))
    version = current.version()

    async def go():
        store = host_store("127.0.0.1", CONTROL_TIMEOUT_S)
        group = f"raw_{uuid.uuid4().hex[:8]}"
        joining = in_daemon_thread(
            lambda: WeightSender(
                backend="gloo", store=store, world_size=2, group_name=group, timeout_s=CONTROL_TIMEOUT_S
            )
        )
        init = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2}
        init.update(group_name=group, backend="gloo")
        assert (await asyncio.to_thread(http, current.url, "/init_weights_update_group", init))[0] == 200
        sender = await joining
        try:
            body = {**bucket.request(group), "weight_version": "v1.2"}
            for session in (False, True):
                if session:
                    assert http(current.url, "/begin_weight_update", {"selector": "all"})[0] == 200
                answer = asyncio.ensure_future(
                    asyncio.to_thread(http, current.url, "/update_weights_from_distributed", body)
                )
                await in_daemon_thread(sender.broadcast, bucket)  # raises when no rank received it
                status, out = await answer
                if not session:
                    assert (status, out) == (400, {"success": False, "message": OUTSIDE_SESSION})
                    assert current.version() == version
            assert status == 200 and out["success"] and http(current.url, "/end_weight_update", {})[0] == 200
            assert current.version() == "v1.2"
            np.testing.assert_array_equal(current.weights(name), bf16(value))
        finally:
            sender.close()
            http(current.url, "/destroy_weights_update_group", {"group_name": group})

    run(go(), timeout_s=60)


def test_a_session_left_open_is_ended_and_a_refused_update_ends_its_own(servers):
    """A session left open on a server (a client stopped during a sync) is ended before the client opens its own;
    an update the server refuses (non-finite values) fails the sync at once and ends the session it opened; the
    server is continued and keeps the pool's version."""
    current = servers[0]
    assert http(current.url, "/begin_weight_update", {})[0] == 200  # what a client stopped mid-sync leaves
    good = hf_tensors(init_model(CONFIG, seed=6))
    bad = {**good, "model.norm.weight": np.full_like(good["model.norm.weight"], np.nan)}
    no_session = (400, {"success": False, "message": f"{NO_SESSION_OPEN}; call begin_weight_update() first"})

    async def go():
        eng = SGLangEngine([current.url], **FAST)
        try:
            await eng.update_weights_from_tensors(good, 21)
            assert http(current.url, "/end_weight_update", {}) == no_session
            with pytest.raises(EngineError, match="non-finite"):
                await eng.update_weights_from_tensors(bad, 22)
            assert http(current.url, "/end_weight_update", {}) == no_session
            assert eng.weight_version == 21 and eng.servers[0].down
            while eng.servers[0].down:  # the probe continues it
                await asyncio.sleep(0.1)
            assert_serves(current, good, 21)
        finally:
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
            assert http(server.url, "/model_info")[1]["weight_version"] == "0"
            while eng.servers[0].down:
                await asyncio.sleep(0.1)
            assert http(
                server.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout_s=5
            )[1]["output_ids"]  # continued, not left paused
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
