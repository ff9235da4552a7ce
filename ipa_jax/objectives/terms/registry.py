"""The registry of objective terms: L = sum over enabled terms of weight_term * numerator_term / denominator_term.

Each term is a small pure function of one (micro)batch returning a (numerator, denominator) pair of scalars whose
denominator depends only on the masks, so numerators and denominators add across microbatches and the train step
can divide every microbatch's numerator by the FULL batch's denominator (composed.py's module doc). A term's
weight is an ObjectiveConfig field; the term is enabled (in the loss) iff that weight is non-zero.

Adding a term (one file under ipa_jax/objectives/terms/ and one test):

1. Add its weight to ObjectiveConfig (config.py), default 0.0 (off), validated as a finite number (the weights
   loop of __post_init__); it becomes the config key objective.<weight> by itself.
2. Write ipa_jax/objectives/terms/<name>.py with two pure functions and one register_term call:

       def my_term(batch: TermBatch, config: ObjectiveConfig) -> tuple[jax.Array, jax.Array]:
           # [B, T] -> scalars: num = sum_{i,t action} scale_{i,t} f(l, r)_{i,t}, den = the aggregation's
           scale, den = action_aggregation(batch.masks, config, batch.log_probs.dtype)
           values = f(batch.log_probs, batch.extras["ref_log_probs"])  # [B, T]
           return jnp.sum(jnp.where(batch.masks.action, scale * values, 0)), den

       register_term(ObjectiveTerm("my", "my_weight", my_term, policy_gradient_denominator,
                                   inputs=("ref_log_probs",)))

   The denominator function returns my_term's den from the masks alone (here the aggregation's, which
   terms/policy_gradient.py's policy_gradient_denominator computes; action_aggregation, also there, takes every
   aggregation setting from the config; terms/entropy.py is a complete example).
   Import the module in terms/__init__.py: registration order is summation order (new terms come last).
3. A term that needs an extra per-token input (reference log-probs, say) names it in `inputs`; the caller passes
   it as extras={"ref_log_probs": [B, T] array} to objective_terms / policy_loss, and to the train step
   (train_step(..., extras=...), TrainStep(...)(..., extras=...)), which splits it into microbatches with the
   batch's rows. The array must not carry gradient unless the term means it to (stop it in the term).
   A missing input is a ValueError naming the term and the input.
4. Test it against a float64 NumPy reference written from the formula (tests/objectives/), values and gradients,
   and with microbatches: the per-microbatch losses with full-batch denominators sum to the full-batch loss.

The train step reports each computed term as the metric <name>_loss (full-batch numerator / denominator).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

import jax

from ipa_jax.objectives.config import ObjectiveConfig
from ipa_jax.objectives.sequences import Sequences


@dataclass(frozen=True)
class TermMasks:
    """The masks of a (micro)batch, all a denominator may read. [B, T]: action bool (the action tokens the loss
    covers), expert bool (imitation targets), chunk_ids int32 (-1 outside actions); sequences: the rows'
    sequences (packed rows: several per row)."""

    action: jax.Array
    expert: jax.Array
    chunk_ids: jax.Array
    sequences: Sequences


@dataclass(frozen=True)
class TermBatch:
    """What a term's value may read, for one (micro)batch, [B, T] in the compute dtype unless noted.

    masks: TermMasks. log_probs l: the current policy's, the only input with gradient. proximal p: the policy
    ratio's denominator (old log-probs, or the behaviour's), stop-gradient. returns G: each action token's credit
    (advantage after credit assignment), stop-gradient. keep bool: the action tokens the policy-gradient term
    keeps (mismatch masks, trust region, entropy filter). weights w = keep * rho * c * G, stop-gradient.
    mismatch_weight c: the capped mismatch weight ([B, T], or the scalar 1 when off). scale: the policy-gradient
    aggregation's per-token scale (Agg(v) = sum(scale * v) / rl_denominator). rl_denominator: its denominator
    on this (micro)batch. entropies: [B, T] or None (a term with needs_entropy gets them; they carry gradient).
    extras: the extra per-token inputs by name (ObjectiveTerm.inputs)."""

    masks: TermMasks
    log_probs: jax.Array
    proximal: jax.Array
    returns: jax.Array
    keep: jax.Array
    weights: jax.Array
    mismatch_weight: jax.Array | float
    scale: jax.Array
    rl_denominator: jax.Array
    entropies: jax.Array | None = None
    extras: Mapping[str, jax.Array] = field(default_factory=dict)


TermValue = Callable[[TermBatch, ObjectiveConfig], tuple[jax.Array, jax.Array]]
TermDenominator = Callable[[TermMasks, ObjectiveConfig], jax.Array]


@dataclass(frozen=True)
class ObjectiveTerm:
    """One term of the loss. name: its key in the terms dict and its metric <name>_loss; weight: the
    ObjectiveConfig field holding its weight; value: (TermBatch, config) -> (numerator, denominator) scalars;
    denominator: (TermMasks, config) -> the same denominator from the masks alone (computed on the full batch);
    inputs: names of the extra per-token inputs it reads from TermBatch.extras; needs_entropy: it reads
    TermBatch.entropies; always: computed and reported even at weight 0 (its metric is in every run's log)."""

    name: str
    weight: str
    value: TermValue
    denominator: TermDenominator
    inputs: tuple[str, ...] = ()
    needs_entropy: bool = False
    always: bool = False


TERMS: dict[str, ObjectiveTerm] = {}
_WEIGHT_FIELDS = {f.name for f in fields(ObjectiveConfig)}


def register_term(term: ObjectiveTerm) -> ObjectiveTerm:
    """Adds `term` to TERMS (after every term registered before it: summation order). ValueError on a name taken
    or a weight that is not an ObjectiveConfig field."""
    if term.name in TERMS:
        raise ValueError(f"objective term {term.name!r}: already registered")
    if term.weight not in _WEIGHT_FIELDS:
        raise ValueError(f"objective term {term.name!r}: weight {term.weight!r} is not an ObjectiveConfig field")
    TERMS[term.name] = term
    return term


def term_weight(term: ObjectiveTerm, config: ObjectiveConfig) -> float:
    return getattr(config, term.weight)


def computed_terms(config: ObjectiveConfig) -> tuple[ObjectiveTerm, ...]:
    """The terms objective_terms computes under `config`: the enabled ones (weight != 0) and the `always` ones."""
    return tuple(t for t in TERMS.values() if t.always or term_weight(t, config) != 0)


def enabled_terms(config: ObjectiveConfig) -> tuple[ObjectiveTerm, ...]:
    """The terms in the loss under `config` (weight != 0), in registration order."""
    return tuple(t for t in TERMS.values() if term_weight(t, config) != 0)


def required_inputs(config: ObjectiveConfig) -> tuple[str, ...]:
    """The extra per-token inputs the computed terms read (ObjectiveTerm.inputs), without repeats."""
    return tuple(dict.fromkeys(name for t in computed_terms(config) for name in t.inputs))


def needs_entropy(config: ObjectiveConfig) -> bool:
    """Whether a computed term reads the token entropies."""
    return any(t.needs_entropy for t in computed_terms(config))
