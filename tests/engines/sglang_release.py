"""SGLang's own code from the pinned release's wheel, for the contract test (test_engines_sglang_contract.py) and its
stand-in server (sglang_standin.py). The wheel is installed with `pip install --no-deps` (README, Tests): its
dependencies are CUDA builds.

Importing the `sglang` package needs CUDA-only packages (its __init__ imports triton, sgl_kernel, flashinfer,
torchvision, ...), so nothing here imports it. Modules whose own imports are light are loaded from their files; of the
others only the definitions the tests run are taken: their source text, executed in a module given the few names they
use (`definitions`), in place of the module's import block.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import importlib.util
import ipaddress
import logging
import pathlib
import socket
import sys
import time
import types
import typing
from contextlib import contextmanager

SGLANG_RELEASE = "0.5.23"
INSTALL = f"pip install --no-deps sglang=={SGLANG_RELEASE}"

# The names of `typing` the definitions below annotate with.
TYPING = {name: getattr(typing, name) for name in ("Any", "Callable", "Dict", "Iterator", "List", "Literal")} | {
    name: getattr(typing, name) for name in ("Optional", "Set", "Tuple", "Union")
}
# The request structs of io_struct.py that the weight sync's routes take (and the outputs the scheduler returns).
REQUEST_STRUCTS = (
    "AbortReq",
    "BeginWeightUpdateReqInput",
    "BeginWeightUpdateReqOutput",
    "ContinueGenerationReqInput",
    "DestroyWeightsUpdateGroupReqInput",
    "DestroyWeightsUpdateGroupReqOutput",
    "EndWeightUpdateReqInput",
    "EndWeightUpdateReqOutput",
    "GetWeightsByNameReqInput",
    "InitWeightsUpdateGroupReqInput",
    "InitWeightsUpdateGroupReqOutput",
    "PauseGenerationReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightFromDiskReqOutput",
    "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromDistributedReqOutput",
)


def package_dir() -> pathlib.Path:
    """Where the wheel's `sglang` package lies (found, not imported); RuntimeError unless it is the pinned release."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"SGLang's wheel is not installed here: {INSTALL} (README, Tests)")
    installed = importlib.metadata.version("sglang")
    if installed != SGLANG_RELEASE:
        raise RuntimeError(f"SGLang {installed} is installed, the contract test pins {SGLANG_RELEASE}: {INSTALL}")
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def _module_name(relative_path: str) -> str:
    return "sglang_release." + relative_path.removesuffix(".py").replace("/", ".")


def load_module(relative_path: str) -> types.ModuleType:
    """A module of the wheel that imports only light packages (msgspec, pydantic, the standard library), from its
    file, under a name of its own."""
    name = _module_name(relative_path)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, package_dir() / relative_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _defined_name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def definitions(relative_path: str, names: typing.Iterable[str], namespace: dict[str, typing.Any]) -> types.ModuleType:
    """The top-level classes, functions and assignments `names` of a module of the wheel, run (in file order, under
    its `from __future__` imports) in a new module holding `namespace`: what they use, in place of the module's
    imports. RuntimeError when one is missing (the release changed the code the tests rely on)."""
    path = package_dir() / relative_path
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    picked = [node for node in tree.body if _defined_name(node) in set(names)]
    missing = set(names) - {_defined_name(node) for node in picked}
    if missing:
        raise RuntimeError(f"{relative_path} of SGLang {SGLANG_RELEASE} defines none of {sorted(missing)}")
    future = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "__future__"]
    module = types.ModuleType(_module_name(relative_path))
    module.__dict__.update(namespace)
    sys.modules[module.__name__] = module  # msgspec and dataclasses resolve annotations through it
    exec(compile(ast.Module(body=future + picked, type_ignores=[]), str(path), "exec"), module.__dict__)
    return module


# ---------------------------------------------------------------------------------------------- the pieces
def version() -> str:
    """The release's own version string (what its /server_info reports)."""
    return load_module("_version.py").__version__


def io_structs() -> types.ModuleType:
    """REQUEST_STRUCTS (and the BaseReq they extend) from managers/io_struct.py, validated over HTTP as SGLang does:
    FastAPI through pydantic, with the schema of utils/msgspec_utils.py."""
    import msgspec

    schema = load_module("srt/utils/msgspec_utils.py").msgspec_struct_pydantic_core_schema
    common = {"msgspec": msgspec, "msgspec_struct_pydantic_core_schema": schema, **TYPING}
    spans = definitions("srt/utils/weight_versions.py", ["WeightVersionSpan", "WeightVersionSpans"], common)
    return definitions(
        "srt/managers/io_struct.py",
        ["BaseReq", "FinishReasonDict", *REQUEST_STRUCTS],
        {**common, "WeightVersionSpans": spans.WeightVersionSpans},
    )


def generate_contract() -> types.ModuleType:
    """api/v1/api_types.py: the schema 0.5.23's /generate checks a body against (GenerateRequest.from_json_value)."""
    return load_module("api/v1/api_types.py")


def auth() -> types.ModuleType:
    """utils/auth.py: decide_request_auth, AuthLevel (a module SGLang keeps free of heavy imports)."""
    return load_module("srt/utils/auth.py")


def weight_updaters(structs: types.ModuleType) -> tuple[type, type]:
    """(SchedulerWeightUpdaterManager, WeightUpdater): the scheduler's weight updates (the session rule, receive then
    load, the version) and the model runner's group creation and receive (init_custom_process_group)."""
    import msgspec
    import torch
    from packaging import version as packaging_version

    process_group = definitions(
        "srt/utils/common.py",
        ["init_custom_process_group"],
        {"torch_release": packaging_version.parse(torch.__version__).release},
    )
    network = definitions(
        "srt/utils/network.py",
        ["_is_ipv6", "_wrap", "NetworkAddress"],
        {"ipaddress": ipaddress, "socket": socket, "dataclass": dataclasses.dataclass, **TYPING},
    )
    dataclass_names = {"dataclass": dataclasses.dataclass, "field": dataclasses.field, **TYPING}
    runner = definitions(
        "srt/model_executor/model_runner_components/weight_updater.py",
        ["WeightUpdater"],
        {
            "torch": torch,
            "logger": logging.getLogger("sglang.weight_updater"),
            "NetworkAddress": network.NetworkAddress,
            "init_custom_process_group": process_group.init_custom_process_group,
            **dataclass_names,
        },
    )
    scheduler = definitions(
        "srt/managers/scheduler_components/weight_updater.py",
        ["_parse_runner_selector", "_WeightUpdateSession", "SchedulerWeightUpdaterManager"],
        {
            "torch": torch,
            "msgspec": msgspec,
            "time": time,
            "contextmanager": contextmanager,
            "logger": logging.getLogger("sglang.scheduler_weight_updater"),
            # its __post_init__ reads the TP group from the server's runtime context; here: one process, one rank
            "get_parallel": lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=None)),
            **{name: getattr(structs, name) for name in REQUEST_STRUCTS},
            **dataclass_names,
        },
    )
    return scheduler.SchedulerWeightUpdaterManager, runner.WeightUpdater


@dataclasses.dataclass(frozen=True)
class Route:
    """A route of entrypoints/http_server.py: its methods, its auth level (AuthLevel's value; "normal" when
    untagged) and the class of its body (None without one)."""

    path: str
    methods: tuple[str, ...]
    auth_level: str
    body: str | None


def http_routes() -> dict[str, Route]:
    """The route table of entrypoints/http_server.py, read from its decorators and signatures."""
    path = package_dir() / "srt/entrypoints/http_server.py"
    routes = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        methods: dict[str, tuple[str, ...]] = {}  # path -> its methods
        level = "normal"
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
                if isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name) and deco.func.id == "auth_level":
                    level = deco.args[0].attr.lower()  # AuthLevel.ADMIN_OPTIONAL -> "admin_optional"
                continue
            verb, args = deco.func.attr, deco.args
            if not (args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)):
                continue  # a path from the environment (Vertex, Ollama): not one the tests use
            if verb in ("get", "post", "put", "delete", "head"):
                methods[args[0].value] = methods.get(args[0].value, ()) + (verb.upper(),)
            elif verb == "api_route":
                listed = next(k.value for k in deco.keywords if k.arg == "methods")
                methods[args[0].value] = tuple(m.value for m in listed.elts)
        body = None
        for arg in node.args.args:
            annotation = arg.annotation
            if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Annotated":
                annotation = annotation.slice.elts[0]
            if arg.arg == "obj" and annotation is not None:
                body = ast.unparse(annotation)
        for route_path, route_methods in methods.items():
            routes[route_path] = Route(route_path, route_methods, level, body)
    return routes
