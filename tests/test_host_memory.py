"""ipa_jax's malloc settings (ipa_jax/host_memory.py): applied by an explicit call (the entry points'), never by
`import ipa_jax`; with them a jitted computation's large buffers are reused from one call to the next instead of
faulted in afresh, counted in page faults in fresh processes with and without them."""

import json
import os
import subprocess
import sys

import pytest

from ipa_jax.host_memory import keep_freed_host_memory

# 80 MB in and out: XLA's CPU client allocates the output from a worker thread, an mmap under glibc's defaults.
SCRIPT = """
import json, resource, statistics, sys
import ipa_jax.pipeline
from ipa_jax.host_memory import host_memory_kept, keep_freed_host_memory
if sys.argv[1] == "call":
    keep_freed_host_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sin(x) * 2.0)
x = jnp.ones((20_000_000,), jnp.float32)

def faults_of_one_call():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = f(x).block_until_ready()
    del y
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

for _ in range(8):  # the heap grows over the first calls (outputs whose free is still in flight), then holds
    faults_of_one_call()
faults = statistics.median(faults_of_one_call() for _ in range(15))
print(json.dumps({"faults_per_call": faults, "applies": host_memory_kept()}))
"""


def _faults_per_call(mode: str) -> dict:
    """In a fresh process that imports ipa_jax and calls keep_freed_host_memory() (mode "call") or not ("import")."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    env.pop("IPA_JAX_KEEP_HOST_MEMORY", None)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_large_buffers_are_reused_instead_of_faulted_in_every_call():
    kept, default = _faults_per_call("call"), _faults_per_call("import")
    if not kept["applies"]:
        pytest.skip("not glibc (musl?): the settings do not apply")
    assert not default["applies"]  # importing ipa_jax (and its pipeline) keeps glibc's defaults
    assert default["faults_per_call"] > 15_000, default  # the 80 MB output faulted in again: 4 KiB pages (median)
    assert kept["faults_per_call"] < 0.1 * default["faults_per_call"], (kept, default)


def test_the_environment_variable_keeps_glibcs_defaults(monkeypatch):
    monkeypatch.setenv("IPA_JAX_KEEP_HOST_MEMORY", "0")
    assert keep_freed_host_memory() is False
