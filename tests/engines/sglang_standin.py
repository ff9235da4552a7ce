"""One SGLang server of the pinned release, as the trainer's weight sync meets it, made of SGLang's own code where that
imports without a GPU (sglang_release.py); the contract test (test_engines_sglang_contract.py) runs it:

    python tests/engines/sglang_standin.py --port P [--api-key K] [--admin-api-key K] [--pp-size N] [--dp-size N]

SGLang's code run here: the route table and auth levels of entrypoints/http_server.py; each route's request struct
(managers/io_struct.py), validated as FastAPI validates it (pydantic, through utils/msgspec_utils.py's schema); the
/generate contract gate (api/v1/api_types.py); decide_request_auth (utils/auth.py); the scheduler's
SchedulerWeightUpdaterManager (the weight-update session rule, receive then load, the version it records); the model
runner's WeightUpdater for the weight-update group (init_custom_process_group over a tcp:// rendezvous) and the
receive of each broadcast.

Re-implemented, because the modules around those need CUDA-only packages (triton, sgl_kernel, flashinfer, ...):
* the HTTP layer of http_server.py: a weight route answers its scheduler output's {"success", "message"} with 200 or
  400, a body its struct refuses is a 400 in FastAPI's validation-error shape, /generate answers one token;
* TokenizerManager's part (tokenizer_manager.py, tokenizer_control_mixin.py): after a successful update carrying a
  weight_version that version is served (/model_info) and " Weight version updated to <v>." ends the message; the
  scheduler runs one call at a time; pause and continue only answer (no request runs here);
* TpModelWorker's adapters (tp_worker.py): init and destroy hand the struct's fields to WeightUpdater, the target
  runner is the only one weight updates apply to;
* the model: WeightUpdater's methods that touch the model (load_weights_from_distributed, update_weights_from_disk,
  begin_weight_update, end_weight_update) record what they get instead, for GET /_record;
* the server's default torch.distributed group, which SGLang's group creation asserts: one rank over gloo.
/server_info reports the wheel's version and --pp-size, --dp-size (one TP rank: this is one process).
"""

import argparse
import asyncio
import concurrent.futures
import json
import logging
import types

import msgspec
import pydantic
import sglang_release
import torch
from aiohttp import web


class Recorder:
    """What the stand-in was asked and what its model got."""

    def __init__(self):
        self.requests: list[dict] = []  # path, status, the keys its struct ignores
        self.loaded: list[tuple[str, torch.Tensor]] = []  # in load order
        self.events: list[str] = []  # session begins and ends, disk loads

    def as_json(self) -> dict:
        return {
            "requests": self.requests,
            "loaded": [[name, t.float().flatten().tolist()] for name, t in self.loaded],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in self.loaded],
            "events": self.events,
        }


def recording_weight_updater(weight_updater: type) -> type:
    """SGLang's WeightUpdater with its model-side methods recording what they get (the Recorder is its get_model())."""

    class RecordingWeightUpdater(weight_updater):
        def load_weights_from_distributed(self, named_tensors):
            self.get_model().loaded.extend(named_tensors)
            return True, "Succeeded to update parameter online."

        def update_weights_from_disk(
            self, model_path, load_format, weight_name_filter=None, recapture_cuda_graph=False
        ):
            self.get_model().events.append(f"disk {model_path}")
            return True, "Succeeded to update model weights."

        def begin_weight_update(self):
            self.get_model().events.append("begin")

        def end_weight_update(self, *, run_post_load):
            self.get_model().events.append("end")

    return RecordingWeightUpdater


class TpWorker:
    """tp_worker.py's adapters between the scheduler and the model runner."""

    def __init__(self, model_runner):
        self.model_runner = model_runner

    def init_weights_update_group(self, recv_req):
        updater = self.model_runner.weight_updater
        return updater.init_weights_update_group(
            recv_req.master_address,
            recv_req.master_port,
            recv_req.rank_offset,
            recv_req.world_size,
            recv_req.group_name,
            recv_req.backend,
        )

    def destroy_weights_update_group(self, recv_req):
        return self.model_runner.weight_updater.destroy_weights_update_group(recv_req.group_name)

    def weight_update_runners(self):
        return [("target", self.model_runner)]


class StandIn:
    def __init__(self, api_key: str | None, admin_api_key: str | None, pp_size: int, dp_size: int):
        self.api_key, self.admin_api_key, self.pp_size, self.dp_size = api_key, admin_api_key, pp_size, dp_size
        self.routes = sglang_release.http_routes()
        self.structs = sglang_release.io_structs()
        self.auth = sglang_release.auth()
        self.contract = sglang_release.generate_contract()
        self.version = sglang_release.version()
        manager_class, updater_class = sglang_release.weight_updaters(self.structs)
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        self.record = Recorder()
        updater = recording_weight_updater(updater_class)(
            tp_rank=0,
            device="cpu",
            gpu_id=0,
            model_config=None,
            custom_weight_loaders={},
            get_model=lambda: self.record,
            update_model_fields=None,
            recapture_cuda_graph=None,
            get_model_runner=None,
        )
        self.manager = manager_class(
            tp_worker=TpWorker(types.SimpleNamespace(weight_updater=updater)),
            draft_worker=None,
            memory_saver_adapter=None,
            flush_cache=lambda empty_cache=False: True,  # nothing cached: no request runs here
            is_fully_idle=lambda **_: True,
            scheduler=types.SimpleNamespace(record_weight_version_change=lambda new_version: None),
        )
        self.scheduler = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # the scheduler's one thread
        self.weight_version = "default"
        self.handlers = {
            "/init_weights_update_group": self.manager.init_weights_update_group,
            "/destroy_weights_update_group": self.manager.destroy_weights_update_group,
            "/begin_weight_update": self.manager.begin_weight_update,
            "/end_weight_update": self.manager.end_weight_update,
            "/update_weights_from_distributed": self.manager.update_weights_from_distributed,
            "/update_weights_from_disk": self.manager.update_weights_from_disk,
        }

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/_record":
            return web.json_response(self.record.as_json())
        route = self.routes.get(request.path)
        if route is None or request.method not in route.methods:
            return web.json_response({"detail": "Not Found"}, status=404)
        level = self.auth.AuthLevel(route.auth_level)
        decision = self.auth.decide_request_auth(
            method=request.method,
            path=request.path,
            authorization_header=request.headers.get("Authorization"),
            api_key=self.api_key,
            admin_api_key=self.admin_api_key,
            auth_level=level,
        )
        if not decision.allowed:
            error = "Unauthorized" if decision.error_status_code == 401 else "Forbidden"
            return self._answer(route.path, web.json_response({"error": error}, status=decision.error_status_code))
        raw = await request.read()
        body = json.loads(raw) if raw.strip() else None
        ignored: list[str] = []
        if route.body == "GenerateReqInput":
            try:
                self.contract.GenerateRequest.from_json_value(body)
            except self.contract.JsonContractError as e:
                return self._answer(route.path, web.json_response({"error": str(e)}, status=400))
            return self._answer(route.path, web.json_response(self._generated(body)))
        obj = None
        if route.body is not None:
            struct = getattr(self.structs, route.body, None)
            if struct is None:
                return self._answer(route.path, web.json_response({"detail": "not in the stand-in"}, status=501))
            try:
                obj = pydantic.TypeAdapter(struct).validate_python(body)
            except pydantic.ValidationError as e:
                message = {"object": "error", "message": str(e), "type": "Bad Request", "param": None, "code": 400}
                return self._answer(route.path, web.json_response(message, status=400))
            ignored = sorted(set(body) - {f.name for f in msgspec.structs.fields(struct)})
        return self._answer(route.path, await self._serve(route.path, obj), ignored)

    def _answer(self, path: str, response: web.Response, ignored: list[str] = ()) -> web.Response:
        self.record.requests.append({"path": path, "status": response.status, "ignored": list(ignored)})
        return response

    async def _serve(self, path: str, obj) -> web.Response:
        if path in self.handlers:
            out = await asyncio.get_running_loop().run_in_executor(self.scheduler, self.handlers[path], obj)
            content = {"success": out.success, "message": out.message}
            version = getattr(obj, "weight_version", None)
            if out.success and version is not None:
                self.weight_version = version
                content["message"] += f" Weight version updated to {version}."
            if path == "/update_weights_from_disk":
                content["num_paused_requests"] = out.num_paused_requests
            return web.json_response(content, status=200 if out.success else 400)
        if path in ("/model_info", "/get_model_info"):
            return web.json_response({"model_path": "stand-in", "weight_version": self.weight_version})
        if path in ("/server_info", "/get_server_info"):
            sizes = {"tp_size": 1, "pp_size": self.pp_size, "dp_size": self.dp_size}
            return web.json_response({"version": self.version, **sizes})
        if path in ("/pause_generation", "/continue_generation"):
            verb = "paused" if path == "/pause_generation" else "continued"
            return web.json_response({"message": f"Generation {verb} successfully.", "status": "ok"})
        if path in ("/health", "/health_generate", "/abort_request"):
            return web.Response(status=200)
        return web.json_response({"detail": "not in the stand-in"}, status=501)

    def _generated(self, body: dict) -> dict:
        """One token, whatever was asked (the client takes a "length" finish)."""
        return {
            "output_ids": [7],
            "meta_info": {
                "id": body.get("rid"),
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(body["input_ids"]),
                "weight_version": self.weight_version,
                "completion_tokens": 1,
                "cached_tokens": 0,
                "output_token_logprobs": [[-0.5, 7, None]],
            },
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", default="")
    parser.add_argument("--admin-api-key", default="")
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--dp-size", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    standin = StandIn(args.api_key or None, args.admin_api_key or None, args.pp_size, args.dp_size)
    app = web.Application(client_max_size=256 * 1024**2)
    app.router.add_route("*", "/{path:.*}", standin.handle)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
