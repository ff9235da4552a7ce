"""ipa_jax: IPA (chunk-level credit) and FlashREINFORCE for multi-turn tool-using LLM agents, in JAX."""

import os

# ipa_jax uses transformers for tokenizers and configs only; without PyTorch (the default install) transformers would
# advise on every start that its models are unavailable.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
