"""ipa_jax: IPA (chunk-level credit) and FlashREINFORCE for multi-turn tool-using LLM agents, in JAX."""
