"""A stand-in for the parts of Ray that the rendered Ray job script uses, to run that script on one machine: remote
functions run in threads; the placement group and each task's bundle are recorded as JSON lines in $FAKE_RAY_LOG."""

import concurrent.futures
import json
import os

from ray import util

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=32)


def record(**event):
    with open(os.environ["FAKE_RAY_LOG"], "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")


def init():
    record(event="init")


class _RemoteFunction:
    def __init__(self, fn, options):
        self.fn, self.options_ = fn, options

    def options(self, **options):
        return _RemoteFunction(self.fn, {**self.options_, **options})

    def remote(self, *args):
        strategy = self.options_.get("scheduling_strategy")
        record(
            event="task",
            name=self.fn.__name__,
            bundle=getattr(strategy, "bundle_index", None),
            num_cpus=self.options_.get("num_cpus"),
            num_gpus=self.options_.get("num_gpus"),
        )
        return _POOL.submit(self.fn, *args)


def remote(**options):
    return lambda fn: _RemoteFunction(fn, options)


def get(refs):
    return [ref.result() for ref in refs] if isinstance(refs, list) else refs.result()


def wait(refs):
    done, _ = concurrent.futures.wait(refs, return_when=concurrent.futures.FIRST_COMPLETED)
    first = next(ref for ref in refs if ref in done)
    return [first], [ref for ref in refs if ref is not first]


def cancel(ref, force=False):
    record(event="cancel", force=force)


__all__ = ["cancel", "get", "init", "remote", "util", "wait"]
