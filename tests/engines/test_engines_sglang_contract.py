"""The client and the dev server against SGLang's own code, from the pinned release's wheel (sglang_release.py).

A stand-in server (sglang_standin.py: what of SGLang it runs, what it re-implements and why) runs the release's
request structs, auth decision, weight-update session rule and broadcast receive: the client's weight syncs must get
through it whole, and the dev server must answer what it answers."""

import asyncio
import os
import sys

import ml_dtypes
import msgspec
import numpy as np
import pytest
import sglang_release
from engine_fakes import FakeEngine, write_fake_weights
from server_process import ServerProcess, cli_flags, http

from ipa_jax.engines import EngineError, SamplingParams, SGLangEngine
from ipa_jax.engines.devserver import KNOWN_SAMPLING_KEYS, OUTSIDE_SESSION, DevServer
from ipa_jax.engines.sglang import ADMIN_ROUTES, SENT_SAMPLING_KEYS

pytest.importorskip("torch")

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_standin.py")
# A refused broadcast costs the client its group's timeout (control_timeout_s): seconds here.
FAST = dict(backoff_s=0.05, max_backoff_s=0.2, probe_interval_s=0.2, down_after_failures=1, control_timeout_s=5.0)


def standin(**flags) -> ServerProcess:
    """A stand-in server in its own process (torch registers weight-update groups by name, per process)."""
    return ServerProcess([sys.executable, STANDIN, *cli_flags(**flags)], start_timeout_s=120.0)


@pytest.fixture(scope="module")
def server():
    started = standin()
    yield started
    started.close()


@pytest.fixture()
def dev_server():
    """Dev servers in this process's threads, with the defaults (the release they behave like)."""
    started = []

    def start(**kwargs) -> DevServer:
        started.append(DevServer(FakeEngine(), **kwargs).serve_in_thread())
        return started[-1]

    yield start
    for s in started:
        s.shutdown()


def record(server: ServerProcess) -> dict:
    return http(server.url, "/_record")[1]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_the_pinned_release_is_installed_and_what_the_stand_in_reports():
    assert sglang_release.version() == sglang_release.SGLANG_RELEASE


def test_a_weight_sync_reaches_sglang_whole_and_exact(server, tmp_path):
    """Two pushed syncs over one group (several buckets each), a sync from disk and a generation: SGLang's structs take
    every body with no key left unread, its scheduler receives every tensor bfloat16-exact in order, inside one
    weight-update session per pushed sync (none for the disk load, which 0.5.23 does not require), and serves the
    version last sent."""
    rng = np.random.default_rng(0)
    syncs = [{f"model.layers.{i}.w": rng.standard_normal((3, 5), np.float32) for i in range(4)} for _ in range(2)]
    before = record(server)

    async def go():
        eng = SGLangEngine([server.url], **FAST)
        try:
            for version, tensors in enumerate(syncs, start=1):
                await eng.update_weights_from_tensors(tensors, version, bucket_bytes=64)  # 2 tensors a bucket
            await eng.update_weights(str(tmp_path), 3)
            return await eng.generate([[1, 2, 3]], SamplingParams(4, stop_token_ids=(5,), stop=("x",)))
        finally:
            await eng.close()

    (result,) = run(go())
    assert result.weight_version == 3
    after = record(server)
    requests = after["requests"][len(before["requests"]) :]
    assert [r for r in requests if r["status"] != 200 or r["ignored"]] == [], requests
    paths = [r["path"] for r in requests]
    assert paths.count("/update_weights_from_distributed") == 4 and "/generate" in paths
    assert after["events"][len(before["events"]) :] == ["begin", "end", "begin", "end", f"disk {tmp_path}"]
    loaded = after["loaded"][len(before["loaded"]) :]
    sent = [(name, value) for tensors in syncs for name, value in tensors.items()]
    assert [name for name, _ in loaded] == [name for name, _ in sent]
    assert set(after["dtypes"]) == {"bfloat16"}
    for (name, got), (_, value) in zip(loaded, sent):
        want = value.astype(ml_dtypes.bfloat16).astype(np.float32).ravel()
        np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=name)


def test_the_dev_server_answers_the_session_and_versions_as_sglang_does(server, dev_server, tmp_path):
    """The same calls to SGLang's code and to the dev server get the same answers: the session's begin and end in and
    out of order, free-form weight versions, and the refusal of an update outside a session (SGLang's message)."""
    dev = dev_server()
    weights = write_fake_weights(str(tmp_path / "w"), offset=1)  # the stand-in records it, the fake engine reads it
    calls = [
        ("/end_weight_update", {}),
        ("/begin_weight_update", {"selector": "all"}),
        ("/begin_weight_update", {}),
        ("/end_weight_update", {}),
        ("/update_weights_from_disk", {"model_path": weights, "weight_version": "v1.2"}),
        ("/model_info", None),
        ("/update_weights_from_disk", {"model_path": weights, "weight_version": "7"}),
    ]
    for path, body in calls:
        want, got = http(server.url, path, body), http(dev.url, path, body)
        if path == "/model_info":
            want, got = want[1]["weight_version"], got[1]["weight_version"]
        assert got == want, (path, body)
    for path, body in [
        ("/end_weight_update", None),  # SGLang's routes need a body, {} at least
        ("/update_weights_from_disk", {"model_path": weights, "weight_version": 8}),  # Optional[str]
    ]:
        (status, refusal), (dev_status, _) = (http(s.url, path, body, method="POST") for s in (server, dev))
        assert status == dev_status == 400 and refusal["object"] == "error", (path, refusal)
    body = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]], "group_name": "none"}
    assert http(server.url, "/update_weights_from_distributed", body) == (
        400,
        {"success": False, "message": OUTSIDE_SESSION},
    )


def test_keys_go_where_sglang_asks_for_them(dev_server, tmp_path):
    """With --api-key and --admin-api-key, SGLang's auth decision and the dev server's agree route by route and key
    by key; a client given both keys syncs (its admin-level calls take the admin key), one given the API key only is
    refused at the pause, with the URL and the status."""
    keys = {"api_key": "user-key", "admin_api_key": "admin-key"}
    sglang = standin(**keys)
    try:
        dev = dev_server(**keys)
        calls = [("/model_info", None), ("/server_info", None), ("/pause_generation", {}), ("/continue_generation", {})]
        for path, body in calls + [("/health_generate", None)]:
            for key in (None, *keys.values()):
                headers = {"Authorization": f"Bearer {key}"} if key else None
                want = http(sglang.url, path, body, headers=headers)[0]
                assert http(dev.url, path, body, headers=headers)[0] == want, (path, key)

        async def go():
            eng = SGLangEngine([sglang.url], **keys, **FAST)
            start = len(record(sglang)["requests"])
            try:
                await eng.update_weights_from_tensors({"w": np.ones(3, np.float32)}, 1)
                await eng.generate([[1]], SamplingParams(2))
            finally:
                await eng.close()
            assert {r["status"] for r in record(sglang)["requests"][start:]} == {200}
            eng = SGLangEngine([sglang.url], api_key=keys["api_key"], **FAST)
            try:
                with pytest.raises(EngineError, match="pause_generation: HTTP 401"):
                    await eng.update_weights(str(tmp_path), 2)
            finally:
                await eng.close()

        run(go())
    finally:
        sglang.close()


def test_pipeline_or_data_parallel_servers_are_refused_before_any_group():
    """pp_size > 1 (the stages' ranks would collide in the group) and dp_size > 1 (SGLang asserts 1) fail the pushed
    sync at once, naming the server and the setting; no group is asked for."""
    pool = [standin(pp_size=2), standin(dp_size=2)]
    try:

        async def go():
            eng = SGLangEngine([s.url for s in pool], **FAST)
            try:
                with pytest.raises(EngineError) as refused:
                    await eng.update_weights_from_tensors({"w": np.ones(3, np.float32)}, 1)
                return str(refused.value)
            finally:
                await eng.close()

        message = run(go())
        assert f"{pool[0].url}: HTTP 200: pp_size=2" in message and f"{pool[1].url}: HTTP 200: dp_size=2" in message
        for s in pool:
            assert "/init_weights_update_group" not in {r["path"] for r in record(s)["requests"]}
    finally:
        for s in pool:
            s.close()


def test_routes_and_keys_of_the_client_and_dev_server_are_sglangs():
    """Every route the dev server serves is one of SGLang's, with a method SGLang takes; ADMIN_ROUTES are exactly
    those SGLang tags admin-level; the sampling keys the dev server knows are those of 0.5.23's /generate schema,
    and the client sends no other."""
    routes = sglang_release.http_routes()
    served: dict[str, set[str]] = {}
    for route in DevServer(FakeEngine()).make_app().router.routes():
        if route.method != "HEAD":  # aiohttp's companion of every GET
            served.setdefault(route.resource.canonical, set()).add(route.method)
    for path, methods in served.items():
        assert path in routes and methods <= set(routes[path].methods), path
        assert (path in ADMIN_ROUTES) == (routes[path].auth_level == "admin_optional"), path
    assert ADMIN_ROUTES <= set(served)
    schema = {f.name for f in msgspec.structs.fields(sglang_release.generate_contract().SamplingParams)}
    assert set(KNOWN_SAMPLING_KEYS) == schema and set(SENT_SAMPLING_KEYS) <= schema
