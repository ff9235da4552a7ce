"""ipa_jax: IPA (chunk-level credit) and FlashREINFORCE for multi-turn tool-using LLM agents, in JAX."""

import os

from ipa_jax.host_memory import keep_freed_host_memory

# ipa_jax uses transformers for tokenizers and configs only; without PyTorch (the default install) transformers would
# advise on every start that its models are unavailable.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Before JAX starts its CPU threads: XLA's per-step CPU buffers are reused instead of faulted in afresh.
HOST_MEMORY_KEPT = keep_freed_host_memory()  # whether the settings applied (ipa_jax/host_memory.py)
