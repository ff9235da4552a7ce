"""Objective terms as an open set: the registry (registry.py; its module doc says how to add a term) and the
built-in terms, each registering itself on import: rl (policy_gradient.py), entropy, il (imitation.py). The order of
registration (the imports below, and theirs) is the order of summation."""

from ipa_jax.objectives.terms import entropy, imitation, kl, policy_gradient  # noqa: F401  (registration)
from ipa_jax.objectives.terms.registry import (
    TERMS,
    ObjectiveTerm,
    TermBatch,
    TermMasks,
    computed_terms,
    enabled_terms,
    needs_entropy,
    register_term,
    required_inputs,
    term_weight,
)

__all__ = [
    "TERMS",
    "ObjectiveTerm",
    "TermBatch",
    "TermMasks",
    "computed_terms",
    "enabled_terms",
    "needs_entropy",
    "register_term",
    "required_inputs",
    "term_weight",
]
