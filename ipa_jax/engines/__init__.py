"""How tokens get sampled: the Engine interface, the SGLang HTTP client, the embedded JAX engine, the dev server.

`EmbeddedEngine` is imported lazily so that rollout hosts that only talk to SGLang never import the model.
"""

from ipa_jax.engines.base import Engine, EngineError, GenerationResult, SamplingParams
from ipa_jax.engines.sglang import SGLangEngine, SGLangHTTPError

__all__ = [
    "Engine",
    "EngineError",
    "GenerationResult",
    "SamplingParams",
    "SGLangEngine",
    "SGLangHTTPError",
    "EmbeddedEngine",
]


def __getattr__(name: str):
    if name == "EmbeddedEngine":
        from ipa_jax.engines.embedded import EmbeddedEngine

        return EmbeddedEngine
    raise AttributeError(f"module 'ipa_jax.engines' has no attribute {name!r}")
