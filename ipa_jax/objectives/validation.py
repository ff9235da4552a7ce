"""Host-side input checks (NumPy) with ValueErrors that name the field and the row. The jitted objective
functions assume valid input; the learner runs these checks (or Trajectory.validate) at the host boundary."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ipa_jax.objectives.config import ObjectiveConfig


def _host(name: str, x: Any) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind == "V" or arr.dtype == object:
        raise ValueError(f"{name}: not a numeric array (dtype {arr.dtype})")
    return arr


def _first_bad_row(bad: np.ndarray) -> int:
    return int(np.argmax(bad.reshape(bad.shape[0], -1).any(axis=1)))


def validate_objective_inputs(log_probs: Any, behavior_log_probs: Any, rewards: Any, action_mask: Any,
                              chunk_ids: Any = None, expert_mask: Any = None, group_ids: Any = None,
                              entropies: Any = None, config: ObjectiveConfig | None = None, *,
                              failures: Any = None, tokens: Any = None, vocab_size: int | None = None,
                              old_log_probs: Any = None) -> None:
    """Raises ValueError for: shape mismatches; non-bool masks; action at position 0 (no predictor); a row with
    no action and no expert token; action log-probs (current, behaviour or old) NaN, inf or > 0; non-finite
    rewards; chunk ids not -1 exactly outside actions or not 0..K-1 non-decreasing (each chunk non-empty)
    inside; expert tokens overlapping actions; token ids outside [0, vocab_size); inputs the config needs but
    lacks (chunk_ids, group_ids, entropies, old_log_probs) and old_log_probs it does not use. Config values
    (delta < 0 or NaN, fractions outside [0, 1]) are checked by ObjectiveConfig itself."""
    lp = _host("log_probs", log_probs)
    if lp.ndim != 2 or lp.size == 0:
        raise ValueError(f"log_probs: must be a non-empty [B, T] array, got shape {lp.shape}")
    B, T = lp.shape
    per_token = {"behavior_log_probs": behavior_log_probs, "action_mask": action_mask, "chunk_ids": chunk_ids,
                 "expert_mask": expert_mask, "entropies": entropies, "tokens": tokens, "old_log_probs": old_log_probs}
    arrays = {name: _host(name, x) for name, x in per_token.items() if x is not None}
    for name, arr in arrays.items():
        if arr.shape != (B, T):
            raise ValueError(f"{name}: shape {arr.shape} does not match log_probs shape {(B, T)}")
    per_row = {"rewards": rewards, "group_ids": group_ids, "failures": failures}
    rows = {name: _host(name, x) for name, x in per_row.items() if x is not None}
    for name, arr in rows.items():
        if arr.shape != (B,):
            raise ValueError(f"{name}: shape {arr.shape} must be [B] = ({B},)")
    for name in ("action_mask", "expert_mask", "failures"):
        arr = arrays.get(name, rows.get(name))
        if arr is not None and arr.dtype != np.bool_:
            raise ValueError(f"{name}: must be a boolean array, got dtype {arr.dtype}")
    action = arrays["action_mask"]
    if action[:, 0].any():
        raise ValueError(f"action_mask: row {int(np.argmax(action[:, 0]))} has an action at position 0, which "
                         "has no predictor")
    empty = ~action.any(axis=1)
    if "expert_mask" in arrays:  # a row of expert tokens only is a pure imitation row
        empty &= ~arrays["expert_mask"].any(axis=1)
    if empty.any():
        raise ValueError(f"action_mask: row {int(np.argmax(empty))} has no action token (and no expert token)")
    log_prob_arrays = {"log_probs": lp, **{k: arrays[k] for k in ("behavior_log_probs", "old_log_probs")
                                           if k in arrays}}
    for name, arr in log_prob_arrays.items():
        a = arr.astype(np.float64)
        bad = action & ~(np.isfinite(a) & (a <= 0))
        if bad.any():
            i = _first_bad_row(bad)
            t = int(np.argmax(bad[i]))
            raise ValueError(f"{name}: action log-prob {a[i, t]} at row {i}, position {t} is NaN, inf or > 0")
    r = rows["rewards"].astype(np.float64)
    if not np.isfinite(r).all():
        raise ValueError(f"rewards: non-finite reward at row {int(np.argmax(~np.isfinite(r)))}")
    if "chunk_ids" in arrays:
        _check_chunk_ids(arrays["chunk_ids"], action)
    if "expert_mask" in arrays and (arrays["expert_mask"] & action).any():
        raise ValueError(f"expert_mask: overlaps action_mask in row {_first_bad_row(arrays['expert_mask'] & action)}")
    if "entropies" in arrays:
        bad = action & ~np.isfinite(arrays["entropies"].astype(np.float64))
        if bad.any():
            raise ValueError(f"entropies: non-finite entropy on an action token in row {_first_bad_row(bad)}")
    if "tokens" in arrays:
        tok = arrays["tokens"]
        if tok.dtype.kind not in "iu":
            raise ValueError(f"tokens: must be integer ids, got dtype {tok.dtype}")
        bad = (tok < 0) | (tok >= vocab_size if vocab_size is not None else False)
        if bad.any():
            i = _first_bad_row(bad)
            raise ValueError(f"tokens: id {int(tok[i][bad[i]][0])} in row {i} is outside the vocabulary "
                             f"[0, {vocab_size})")
    if config is not None:
        if config.uses_chunks and chunk_ids is None:
            raise ValueError("chunk_ids: required by this ObjectiveConfig (a chunk-level option is set)")
        if config.baseline == "group_mean" and group_ids is None:
            raise ValueError("group_ids: required for baseline='group_mean'")
        if config.negative_token_fraction < 1.0 and entropies is None:
            raise ValueError("entropies: required when negative_token_fraction < 1")
        config.check_old_log_probs(old_log_probs is not None)


def _check_chunk_ids(cid: np.ndarray, action: np.ndarray) -> None:
    if cid.dtype.kind not in "iu":
        raise ValueError(f"chunk_ids: must be integers, got dtype {cid.dtype}")
    outside = ~action & (cid != -1)
    if outside.any():
        raise ValueError(f"chunk_ids: must be -1 outside action tokens (row {_first_bad_row(outside)})")
    for i in range(cid.shape[0]):
        inside = cid[i][action[i]]
        if inside.size == 0:  # a pure imitation row
            continue
        steps = np.diff(inside)
        if inside[0] != 0 or ((steps != 0) & (steps != 1)).any():
            raise ValueError(f"chunk_ids: row {i} is not 0..K-1 non-decreasing over its action tokens with every "
                             f"chunk non-empty (starts {inside[:12].tolist()})")


def validate_if_concrete(*args: Any, **kwargs: Any) -> None:
    """validate_objective_inputs when called eagerly; inside jit (tracers) the inputs cannot be inspected."""
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        validate_objective_inputs(*args, **kwargs)
