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


def validate_objective_inputs(
    log_probs: Any,
    behavior_log_probs: Any,
    rewards: Any,
    action_mask: Any,
    chunk_ids: Any = None,
    expert_mask: Any = None,
    group_ids: Any = None,
    entropies: Any = None,
    config: ObjectiveConfig | None = None,
    *,
    failures: Any = None,
    tokens: Any = None,
    vocab_size: int | None = None,
    old_log_probs: Any = None,
    segment_ids: Any = None,
    truncated: Any = None,
) -> None:
    """Raises ValueError for: shape mismatches; non-bool masks; action at position 0 (no predictor); a row with
    no action and no expert token; action log-probs (current, behaviour or old) NaN, inf or > 0; non-finite
    rewards; chunk ids not -1 exactly outside actions or not 0..K-1 non-decreasing (each chunk non-empty)
    inside; expert tokens overlapping actions; token ids outside [0, vocab_size); inputs the config needs but
    lacks (chunk_ids, group_ids, entropies, old_log_probs, truncated) and old_log_probs it does not use. Config values
    (delta < 0 or NaN, fractions outside [0, 1]) are checked by ObjectiveConfig itself.

    Packed rows (segment_ids [B, T]): rewards, group_ids and failures are [B, S]; segment ids are in [0, S], each
    row's non-zero ids form increasing contiguous runs; every sequence (not every row) needs an action or expert
    token, never on its first token or on padding; chunk ids run 0..K-1 along the whole row."""
    lp = _host("log_probs", log_probs)
    if lp.ndim != 2 or lp.size == 0:
        raise ValueError(f"log_probs: must be a non-empty [B, T] array, got shape {lp.shape}")
    B, T = lp.shape
    per_token = {
        "behavior_log_probs": behavior_log_probs,
        "action_mask": action_mask,
        "chunk_ids": chunk_ids,
        "expert_mask": expert_mask,
        "entropies": entropies,
        "tokens": tokens,
        "old_log_probs": old_log_probs,
    }
    arrays = {name: _host(name, x) for name, x in per_token.items() if x is not None}
    for name, arr in arrays.items():
        if arr.shape != (B, T):
            raise ValueError(f"{name}: shape {arr.shape} does not match log_probs shape {(B, T)}")
    per_row = {"rewards": rewards, "group_ids": group_ids, "failures": failures}
    rows = {name: _host(name, x) for name, x in per_row.items() if x is not None}
    segments = None if segment_ids is None else _check_segment_ids(_host("segment_ids", segment_ids), B, T)
    for name, arr in rows.items():
        if segments is None and arr.shape != (B,):
            raise ValueError(f"{name}: shape {arr.shape} must be [B] = ({B},)")
        if segments is not None and (arr.ndim != 2 or arr.shape[0] != B or arr.shape[1] < segments.max(initial=0)):
            raise ValueError(
                f"{name}: shape {arr.shape} must be [B, S] = ({B}, S) with S >= the largest segment id "
                f"{int(segments.max(initial=0))} (one per sequence slot of the packed rows)"
            )
    for name in ("action_mask", "expert_mask", "failures"):
        arr = arrays.get(name, rows.get(name))
        if arr is not None and arr.dtype != np.bool_:
            raise ValueError(f"{name}: must be a boolean array, got dtype {arr.dtype}")
    action = arrays["action_mask"]
    if action[:, 0].any():
        raise ValueError(
            f"action_mask: row {int(np.argmax(action[:, 0]))} has an action at position 0, which has no predictor"
        )
    targets = action | arrays["expert_mask"] if "expert_mask" in arrays else action
    if segments is None:
        empty = ~targets.any(axis=1)  # a row of expert tokens only is a pure imitation row
        if empty.any():
            raise ValueError(f"action_mask: row {int(np.argmax(empty))} has no action token (and no expert token)")
    else:
        _check_packed_targets(targets, segments)
    log_prob_arrays = {
        "log_probs": lp,
        **{k: arrays[k] for k in ("behavior_log_probs", "old_log_probs") if k in arrays},
    }
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
            raise ValueError(
                f"tokens: id {int(tok[i][bad[i]][0])} in row {i} is outside the vocabulary [0, {vocab_size})"
            )
    if config is not None:
        if config.uses_chunks and chunk_ids is None:
            raise ValueError("chunk_ids: required by this ObjectiveConfig (a chunk-level option is set)")
        if config.needs_group_ids and group_ids is None:
            raise ValueError(f"group_ids: required for baseline={config.baseline!r}")
        if config.negative_token_fraction < 1.0 and entropies is None:
            raise ValueError("entropies: required when negative_token_fraction < 1")
        if config.overlong_filter:
            _check_truncated(truncated, np.shape(rewards))
        config.check_old_log_probs(old_log_probs is not None)


def _check_truncated(truncated: Any, shape: tuple[int, ...]) -> None:
    """truncated: bool, one per trajectory (the rewards' shape), required by overlong_filter."""
    if truncated is None:
        raise ValueError("truncated: required by overlong_filter (which episodes ran out of tokens)")
    arr = _host("truncated", truncated)
    if arr.dtype != bool or arr.shape != shape:
        raise ValueError(f"truncated: must be bool with the rewards' shape {shape}, got {arr.dtype} {arr.shape}")


def _check_segment_ids(seg: np.ndarray, B: int, T: int) -> np.ndarray:
    """segment_ids int[B, T] >= 0 whose non-zero ids form increasing contiguous runs in each row; returns them."""
    if seg.shape != (B, T):
        raise ValueError(f"segment_ids: shape {seg.shape} does not match log_probs shape {(B, T)}")
    if seg.dtype.kind not in "iu" or (seg < 0).any():
        raise ValueError(f"segment_ids: must be integers >= 0 (0 = padding), got dtype {seg.dtype}")
    for i in range(B):
        runs = seg[i][np.r_[True, seg[i, 1:] != seg[i, :-1]]]  # the id of each run, left to right
        runs = runs[runs > 0]
        if (np.diff(runs) <= 0).any():
            raise ValueError(
                f"segment_ids: row {i} is not increasing contiguous runs of ids (runs {runs[:12].tolist()})"
            )
    return seg


def _check_packed_targets(targets: np.ndarray, seg: np.ndarray) -> None:
    """Every sequence of a packed row has an action or expert token, none on padding or on its first token."""
    first = np.pad(seg[:, 1:] != seg[:, :-1], ((0, 0), (1, 0)), constant_values=True)
    bad = targets & ((seg == 0) | first)
    if bad.any():
        raise ValueError(
            f"action_mask: row {_first_bad_row(bad)} has an action or expert token on padding or on the "
            "first token of a segment, which has no predictor"
        )
    for i in range(seg.shape[0]):
        for s in np.unique(seg[i][seg[i] > 0]):
            if not targets[i][seg[i] == s].any():
                raise ValueError(f"action_mask: row {i}, segment {int(s)} has no action token (and no expert token)")


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
            raise ValueError(
                f"chunk_ids: row {i} is not 0..K-1 non-decreasing over its action tokens with every "
                f"chunk non-empty (starts {inside[:12].tolist()})"
            )


def validate_if_concrete(*args: Any, **kwargs: Any) -> None:
    """validate_objective_inputs when called eagerly; inside jit (tracers) the inputs cannot be inspected."""
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        validate_objective_inputs(*args, **kwargs)
