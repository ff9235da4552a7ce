"""Shared test setup: 8 fake CPU devices so every sharding can be tested on one machine."""

import os

# Must happen before JAX initialises its backend; a test run imports this first.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
