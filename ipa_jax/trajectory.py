"""The Trajectory record (host side, NumPy only), its validation, JSONL I/O and padding into a TrajectoryBatch.

Alignment convention: every per-token array is aligned with ``tokens``; position t holds the quantity of token t
predicted from tokens[:t]. Position 0 has no predictor, so it is never an action (nor an expert target).

A trajectory is one complete episode (prompt, every generated turn, every tool observation) in one token row.
``chunk_ids`` numbers the interaction chunks: k for the action tokens of chunk k (0..K-1, non-decreasing,
every chunk non-empty), -1 everywhere else. A row needs at least one action or expert token: a row with
expert tokens only (a scripted expert's episode) is a pure imitation row and takes no part in the RL term.
"""

from __future__ import annotations

import base64
import collections
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

DEFAULT_BUCKETS: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = int(np.iinfo(np.int32).max)

# Canonical dtype of each per-token field; the constructor casts to it when the kind already matches.
_TOKEN_FIELDS: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32),
    "action_mask": np.dtype(np.bool_),
    "behavior_logprobs": np.dtype(np.float32),
    "chunk_ids": np.dtype(np.int32),
    "expert_mask": np.dtype(np.bool_),
}
_KIND_OK = {"i": "iu", "b": "biu", "f": "fiu"}  # accepted source kinds per target kind


def _canonical(value: Any, dtype: np.dtype) -> np.ndarray:
    """np.asarray(value) cast to ``dtype`` when that cast cannot change a valid value (ints in range; 0/1 for
    masks); otherwise left as is so that validate() names the problem (never silently truncate a float id)."""
    arr = np.asarray(value)
    if arr.size == 0:
        return arr.astype(dtype)
    if arr.dtype.kind not in _KIND_OK[dtype.kind]:
        return arr
    if (
        dtype.kind == "i"
        and arr.dtype.kind in "iu"
        and (arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max)
    ):
        return arr
    if dtype.kind == "b" and arr.dtype.kind in "iu" and not np.isin(arr, (0, 1)).all():
        return arr
    return arr.astype(dtype, copy=False)


# The finish reasons (info["finish_reason"], rollout/agent.py) of an episode cut off by its token budget: a turn hit
# max_new_tokens or the context ("length"), or the next observation would not fit the context ("context").
TRUNCATING_FINISHES = ("length", "context")


@dataclass
class Trajectory:
    """One complete episode. Shapes: T tokens, K chunks, L MoE layers, k experts per token.

    uid: unique id; tokens int32[T]; action_mask bool[T] (sampled by the policy: the RL targets);
    behavior_logprobs float32[T] (log-prob the sampler used, 0 outside actions); chunk_ids int32[T];
    expert_mask bool[T] (expert-prefilled imitation targets, disjoint from actions); reward float;
    policy_version int (weight version that sampled it); chunk_versions int32[K] | None (version per chunk);
    routed_experts int32[T, L, k] | None (row t = experts used when processing token t); info dict
    (task_id, env, finish_reason, num_tool_calls, num_tool_errors, ... ; JSON-serialisable);
    chunk_advantages float32[K] | None (a branched episode's Monte Carlo advantage per chunk, rollout/branch.py).
    """

    uid: str
    tokens: np.ndarray
    action_mask: np.ndarray
    behavior_logprobs: np.ndarray
    chunk_ids: np.ndarray
    expert_mask: np.ndarray
    reward: float
    policy_version: int
    chunk_versions: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    info: dict = field(default_factory=dict)
    chunk_advantages: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name, dtype in _TOKEN_FIELDS.items():
            setattr(self, name, _canonical(getattr(self, name), dtype))
        if self.chunk_versions is not None:
            self.chunk_versions = _canonical(self.chunk_versions, np.dtype(np.int32))
        if self.routed_experts is not None:
            self.routed_experts = _canonical(self.routed_experts, np.dtype(np.int32))
        if self.chunk_advantages is not None:
            self.chunk_advantages = _canonical(self.chunk_advantages, np.dtype(np.float32))

    @property
    def num_chunks(self) -> int:
        """K = 1 + the largest chunk id (0 when there is no action token)."""
        return int(self.chunk_ids.max()) + 1 if self.chunk_ids.size and self.chunk_ids.max() >= 0 else 0

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0]) if self.tokens.ndim == 1 else 0

    @property
    def truncated(self) -> bool:
        """Whether the episode ran out of tokens (info["finish_reason"] in TRUNCATING_FINISHES)."""
        return self.info.get("finish_reason") in TRUNCATING_FINISHES

    def _error(self, name: str, problem: str) -> ValueError:
        return ValueError(f"trajectory {self.uid!r}: field {name!r}: {problem}")

    def validate(
        self,
        vocab_size: int | None = None,
        *,
        reward_range: tuple[float, float] | None = None,
        max_version: int | None = None,
    ) -> None:
        """Raises ValueError naming the field and the uid for the first problem found. Beyond the shapes and masks,
        the bounds make every valid trajectory trainable: the reward finite in float32 (and within `reward_range`
        when given), versions within int32 (and at most `max_version`, the learner's, when given)."""
        if not isinstance(self.uid, str) or not self.uid:
            raise self._error("uid", f"must be a non-empty string, got {self.uid!r}")
        tokens = self.tokens
        if tokens.ndim != 1 or tokens.shape[0] < 2:
            raise self._error("tokens", f"must be 1-D with at least 2 tokens, got shape {tokens.shape}")
        if tokens.dtype != np.int32:
            raise self._error("tokens", f"must be integer token ids in int32 range, got dtype {tokens.dtype}")
        if tokens.min() < 0:
            raise self._error("tokens", f"negative token id {int(tokens.min())}")
        if vocab_size is not None and tokens.max() >= vocab_size:
            raise self._error("tokens", f"token id {int(tokens.max())} outside the vocabulary of size {vocab_size}")
        T = tokens.shape[0]
        for name, dtype in _TOKEN_FIELDS.items():
            arr = getattr(self, name)
            if arr.shape != (T,):
                raise self._error(name, f"shape {arr.shape} does not match tokens shape {(T,)}")
            if arr.dtype != dtype:
                raise self._error(name, f"dtype {arr.dtype} cannot be read as {dtype}")
        action, expert = self.action_mask, self.expert_mask
        if action[0]:
            raise self._error("action_mask", "position 0 has no predictor and cannot be an action")
        if not (action.any() or expert.any()):
            raise self._error("action_mask", "no action token (and no expert token)")
        if expert[0]:
            raise self._error("expert_mask", "position 0 has no predictor and cannot be an imitation target")
        if (expert & action).any():
            raise self._error("expert_mask", f"overlaps action_mask at position {int(np.argmax(expert & action))}")
        lp = self.behavior_logprobs
        bad = action & ~(np.isfinite(lp) & (lp <= 0))
        if bad.any():
            t = int(np.argmax(bad))
            raise self._error("behavior_logprobs", f"action log-prob {lp[t]} at position {t} is not finite and <= 0")
        if (lp[~action] != 0).any():
            raise self._error("behavior_logprobs", "must be 0 outside action tokens")
        self._validate_chunks()
        self._validate_reward(reward_range)
        self._validate_versions(max_version)
        self._validate_chunk_advantages()
        if self.routed_experts is not None:
            re = self.routed_experts
            if re.ndim != 3 or re.shape[0] != T or re.dtype != np.int32:
                raise self._error("routed_experts", f"must be int32[T={T}, L, k], got {re.dtype}{list(re.shape)}")
            if re.size and re.min() < 0:
                raise self._error("routed_experts", "expert ids must be >= 0")
        if not isinstance(self.info, dict):
            raise self._error("info", f"must be a dict, got {type(self.info).__name__}")

    def _validate_reward(self, reward_range: tuple[float, float] | None) -> None:
        reward = self.reward
        # Finite in float64 is not enough: the batch holds rewards as float32 (1e300 would become inf there).
        if not isinstance(reward, (int, float, np.floating, np.integer)) or not abs(reward) <= _FLOAT32_MAX:
            raise self._error("reward", f"must be a number that is finite in float32, got {reward!r}")
        if reward_range is not None and not reward_range[0] <= reward <= reward_range[1]:
            raise self._error(
                "reward", f"{reward!r} is outside the accepted range {list(reward_range)} (train.reward_range)"
            )

    def _validate_versions(self, max_version: int | None) -> None:
        version = self.policy_version
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or not 0 <= version <= _INT32_MAX:
            raise self._error("policy_version", f"must be an integer in [0, 2**31 - 1], got {version!r}")
        if max_version is not None and version > max_version:
            raise self._error("policy_version", f"{version} is ahead of the learner's version {max_version}")
        cv = self.chunk_versions
        if cv is not None:
            if cv.shape != (self.num_chunks,) or cv.dtype != np.int32:
                raise self._error(
                    "chunk_versions",
                    f"must be int32[{self.num_chunks}] (one per chunk), got {cv.dtype}{list(cv.shape)}",
                )
            if (cv < 0).any():
                raise self._error("chunk_versions", "versions must be >= 0")
            if max_version is not None and cv.size and cv.max() > max_version:
                raise self._error("chunk_versions", f"{int(cv.max())} is ahead of the learner's version {max_version}")

    def _validate_chunk_advantages(self) -> None:
        ca = self.chunk_advantages
        if ca is None:
            return
        if ca.shape != (self.num_chunks,) or ca.dtype != np.float32:
            got = f"{ca.dtype}{list(ca.shape)}"
            raise self._error("chunk_advantages", f"must be float32[{self.num_chunks}] (one per chunk), got {got}")
        if not np.isfinite(ca).all():
            raise self._error("chunk_advantages", f"must be finite, got {_short(ca)}")

    def _validate_chunks(self) -> None:
        action, cid = self.action_mask, self.chunk_ids
        if (cid[~action] != -1).any():
            t = int(np.argmax((cid != -1) & ~action))
            raise self._error("chunk_ids", f"must be -1 outside action tokens (position {t} holds {cid[t]})")
        inside = cid[action]
        if inside.size and inside[0] != 0:
            raise self._error("chunk_ids", f"the first action token must be in chunk 0, got {inside[0]}")
        steps = np.diff(inside)
        if ((steps != 0) & (steps != 1)).any():
            raise self._error(
                "chunk_ids",
                "must be 0..K-1 non-decreasing over action tokens, each chunk non-empty "
                f"(got the sequence {_short(inside)})",
            )

    # ---- JSON ---------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        """One JSON line. Lossless: float32 values are written as the shortest decimal of their float64 value,
        which parses back to the same float64 and so casts back to the same float32 bit pattern;
        routed_experts (large) as base64 of little-endian int32 with its shape."""
        record: dict[str, Any] = {
            "uid": self.uid,
            "tokens": self.tokens.tolist(),
            "action_mask": self.action_mask.astype(np.uint8).tolist(),
            "behavior_logprobs": np.asarray(self.behavior_logprobs, np.float64).tolist(),
            "chunk_ids": self.chunk_ids.tolist(),
            "expert_mask": self.expert_mask.astype(np.uint8).tolist(),
            "reward": float(self.reward),
            "policy_version": int(self.policy_version),
            "chunk_versions": None if self.chunk_versions is None else self.chunk_versions.tolist(),
            "routed_experts": None
            if self.routed_experts is None
            else {
                "shape": list(self.routed_experts.shape),
                "int32_le_b64": base64.b64encode(self.routed_experts.astype("<i4").tobytes()).decode("ascii"),
            },
            "info": self.info,
            "chunk_advantages": None
            if self.chunk_advantages is None
            else np.asarray(self.chunk_advantages, np.float64).tolist(),
        }
        return json.dumps(record, separators=(",", ":"), default=_json_default)

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        """Inverse of to_json. Raises ValueError on a malformed record (missing field, bad JSON)."""
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"trajectory JSON does not parse: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"trajectory JSON must be an object, got {type(d).__name__}")
        uid = d.get("uid", "<unknown>")
        missing = [
            k
            for k in (
                "uid",
                "tokens",
                "action_mask",
                "behavior_logprobs",
                "chunk_ids",
                "expert_mask",
                "reward",
                "policy_version",
            )
            if k not in d
        ]
        if missing:
            raise ValueError(f"trajectory {uid!r}: missing field(s) {missing}")
        re = d.get("routed_experts")
        if re is not None:
            re = np.frombuffer(base64.b64decode(re["int32_le_b64"]), dtype="<i4").astype(np.int32)
            re = re.reshape(d["routed_experts"]["shape"])  # a wrong shape raises ValueError
        cv = d.get("chunk_versions")
        ca = d.get("chunk_advantages")
        # Plain np.asarray: the constructor casts what is castable without loss, validate() names the rest.
        return cls(
            uid=d["uid"],
            tokens=np.asarray(d["tokens"]),
            action_mask=np.asarray(d["action_mask"]),
            behavior_logprobs=np.asarray(d["behavior_logprobs"], np.float64),
            chunk_ids=np.asarray(d["chunk_ids"]),
            expert_mask=np.asarray(d["expert_mask"]),
            reward=float(d["reward"]),
            policy_version=d["policy_version"],
            chunk_versions=None if cv is None else np.asarray(cv),
            routed_experts=re,
            info=d.get("info") or {},
            chunk_advantages=None if ca is None else np.asarray(ca, np.float64),
        )


class DropLog:
    """Logs dropped trajectories at most once every `interval_s` seconds: how many since the last line, by reason,
    and the latest message (a poisoned source can drop thousands a second; a line each would flood the log, and
    none would hide it). Thread-safe. `level`: logging.DEBUG for drops that are expected and counted elsewhere."""

    def __init__(self, logger: logging.Logger, source: str, interval_s: float = 30.0, level: int = logging.WARNING):
        self.logger, self.source, self.interval_s, self.level = logger, source, interval_s, level
        self._pending: collections.Counter[str] = collections.Counter()
        self._logged_at = -float("inf")
        self._lock = threading.Lock()

    def add(self, reason: str, message: str) -> None:
        with self._lock:
            self._pending[reason] += 1
            now = time.monotonic()
            if now - self._logged_at < self.interval_s:
                return
            pending, self._pending, self._logged_at = self._pending, collections.Counter(), now
        counts = ", ".join(f"{r} {n}" for r, n in pending.most_common())
        self.logger.log(
            self.level,
            "%s dropped %d trajectories (%s) since its last report; latest (%s): %s",
            self.source,
            sum(pending.values()),
            counts,
            reason,
            message,
        )


def _short(a: np.ndarray, n: int = 12) -> str:
    s = a[:n].tolist()
    return f"{s}{'...' if a.size > n else ''}"


def _json_default(obj: Any) -> Any:
    # NumPy scalars/arrays in `info` become plain JSON values.
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"info value of type {type(obj).__name__} is not JSON-serialisable")


def write_jsonl(path: str | os.PathLike, trajs: Iterable[Trajectory], append: bool = False) -> None:
    """Writes one JSON line per trajectory (overwrites ``path``, or adds to its end with ``append``)."""
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        f.writelines(jsonl_lines(trajs))


def jsonl_lines(trajs: Iterable[Trajectory]) -> Iterator[str]:
    """The lines of write_jsonl, for a writer of its own (an object store's file)."""
    for traj in trajs:
        yield traj.to_json() + "\n"


def read_jsonl(path: str | os.PathLike) -> list[Trajectory]:
    """Reads the trajectories written by write_jsonl (blank lines skipped). Does not validate: call
    ``validate()`` on each (the learner drops and counts the bad ones). A malformed line raises a ValueError
    naming the file and line number."""
    with open(path, encoding="utf-8") as f:
        return parse_jsonl(f, os.fspath(path))


def parse_jsonl(lines: Iterable[str], source: str) -> list[Trajectory]:
    """read_jsonl on lines read elsewhere (an object store's file); `source` names them in errors."""
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(Trajectory.from_json(line))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{source}:{lineno}: {e}") from None
    return out


def build_chunk_ids(action_mask: np.ndarray, chunk_end_positions: Sequence[int]) -> np.ndarray:
    """chunk_ids int32[T] from action_mask bool[T] and the token positions where chunks end (the last token
    of each tool call; the final answer's end may be given or not).

    chunk k = the action tokens t with end_{k-1} < t <= end_k; action tokens after the last end form one
    more chunk (the final answer). Each end position must be an action token and the ends strictly
    increasing, so every chunk is non-empty.  chunk_ids[t] = #{ends < t} on actions, -1 elsewhere.
    """
    action = np.asarray(action_mask, dtype=bool)
    if action.ndim != 1:
        raise ValueError(f"action_mask must be 1-D, got shape {action.shape}")
    ends = np.asarray(chunk_end_positions, dtype=np.int64).reshape(-1)
    if ends.size:
        if (np.diff(ends) <= 0).any():
            raise ValueError(f"chunk_end_positions must be strictly increasing, got {_short(ends)}")
        if ends[0] < 0 or ends[-1] >= action.shape[0]:
            raise ValueError(f"chunk_end_positions {_short(ends)} outside [0, {action.shape[0]})")
        if not action[ends].all():
            bad = int(ends[np.argmin(action[ends])])
            raise ValueError(f"chunk_end_positions: position {bad} is not an action token")
    ids = np.searchsorted(ends, np.arange(action.shape[0]), side="left")
    return np.where(action, ids, -1).astype(np.int32)


class TrajectoryBatch(NamedTuple):
    """Device form of trajectories (a JAX pytree): B rows of a length bucket T, right-padded, one trajectory per row
    (pad_batch) or several back to back (pack_batch).

    Padding (after a row's trajectories): tokens = pad_id, attention_mask/action_mask/expert_mask False,
    behavior_logprobs 0, chunk_ids -1, routed_experts 0; positions continue counting (t) in a one-per-row batch.

    Branch values (when any trajectory has chunk_advantages, else None): branch_advantages[i, t] is the advantage
    of token t's chunk and branch_mask[i, t] True on the action tokens of trajectories that have them (0 / False
    elsewhere); the objective's credit "branch" reads them (objectives/credit.py, branch_credit).

    Packed rows (segment_ids not None): the trajectories of row i are runs of segment ids 1, 2, ... (0 = padding);
    positions restart at 0 in every run (padding's too); chunk ids are unique within the row (a trajectory's
    continue the numbering of the one before it); the per-trajectory fields are [B, S], slot s holding the
    trajectory of segment s + 1 (an unused slot: reward 0, group id and policy version -1, not truncated).

    Shared prefixes (prefix_segment_ids not None: pack_batch with share_prefix): a trajectory whose first P tokens
    equal those of its row's first trajectory holds only its tokens from P on, at positions P.. (its own
    positions); prefix_segment_ids marks each such token with the segment it continues (1, the row's first), 0
    elsewhere. Its tokens attend to that segment's tokens at positions < P as to their own prefix, so every
    log-prob is the one of the whole trajectory; P stops before its first scored (action or expert) token's
    predecessor, so every scored token is predicted inside its own segment.
    """

    tokens: np.ndarray  # int32[B, T]
    attention_mask: np.ndarray  # bool[B, T]  real tokens
    positions: np.ndarray  # int32[B, T]  0..T-1 (padding continues the count); packed: 0.. in every segment
    action_mask: np.ndarray  # bool[B, T]
    behavior_logprobs: np.ndarray  # float32[B, T]
    chunk_ids: np.ndarray  # int32[B, T]  -1 outside actions and on padding
    expert_mask: np.ndarray  # bool[B, T]
    rewards: np.ndarray  # float32[B] ([B, S] packed)
    group_ids: np.ndarray  # int32[B] ([B, S])  0..G-1 in order of first appearance of info['task_id'] (uid if absent)
    policy_versions: np.ndarray  # int32[B] ([B, S])
    routed_experts: np.ndarray | None = None  # int32[B, T, L, k]
    segment_ids: np.ndarray | None = None  # int32[B, T] packed rows: 1.. per trajectory, 0 on padding
    branch_advantages: np.ndarray | None = None  # float32[B, T] the token's chunk advantage (branched trajectories)
    branch_mask: np.ndarray | None = None  # bool[B, T] the action tokens of branched trajectories
    truncated: np.ndarray | None = None  # bool[B] ([B, S]) Trajectory.truncated (pad_batch and pack_batch fill it)
    prefix_segment_ids: np.ndarray | None = None  # int32[B, T] shared prefixes: the segment a token continues, else 0


def group_key(traj: Trajectory) -> str:
    """The group a trajectory belongs to for group baselines and dynamic sampling: its info['task_id'] (samples of
    one task), else its uid (a group of its own)."""
    return str(traj.info.get("task_id", traj.uid))


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket >= length; ValueError if length exceeds every bucket."""
    fitting = [b for b in buckets if b >= length]
    if not fitting:
        raise ValueError(f"length {length} exceeds the largest bucket {max(buckets)}")
    return min(fitting)


def _bucket(trajs: Sequence[Trajectory], buckets: Sequence[int]) -> int:
    """Validates the trajectories; T = the smallest bucket that holds the longest one."""
    if not trajs:
        raise ValueError("a batch needs at least one trajectory")
    for traj in trajs:
        traj.validate()
    longest = max(trajs, key=lambda tr: tr.length)
    try:
        return bucket_length(longest.length, buckets)
    except ValueError as e:
        raise ValueError(f"trajectory {longest.uid!r}: field 'tokens': {e}") from None


def pad_batch(
    trajs: Sequence[Trajectory], buckets: Sequence[int] = DEFAULT_BUCKETS, pad_id: int = 0
) -> TrajectoryBatch:
    """Validates and right-pads trajectories into a TrajectoryBatch with T = the smallest bucket >= the
    longest trajectory. routed_experts must be given for all trajectories or for none."""
    return _fill_rows(trajs, [[i] for i in range(len(trajs))], _bucket(trajs, buckets), pad_id, num_slots=None)


def first_fit_decreasing(
    lengths: Sequence[int], capacity: int, shared: Callable[[int, int], int] | None = None
) -> list[list[int]]:
    """Bins of total length <= capacity holding every index of `lengths` once: longest first (ties: lower index),
    each into the first bin with room, else a new bin. Returns each bin's indices in the order placed.
    shared(first, i): the length index i needs less in a bin whose first index is `first` (None: 0)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        if lengths[i] > capacity:
            raise ValueError(f"length {lengths[i]} at index {i} exceeds the capacity {capacity}")
        need = [lengths[i] - (shared(bin_[0], i) if shared else 0) for bin_ in bins]
        b = next((k for k, free in enumerate(room) if free >= need[k]), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(capacity)
            need.append(lengths[i])
        bins[b].append(i)
        room[b] -= need[b]
    return bins


def packed_row_count(needed: int, multiple: int, most: int) -> int:
    """Rows of a packed batch: the fewest of (1, 2, 3, 4, 6, 8, 12, 16, ...) * multiple (powers of two and three
    times them) that hold `needed` rows, capped at `most`. Few distinct counts bound the train step's recompiles;
    fewer than a third of the rows are empty."""
    units = -(-needed // multiple)
    power = 1 << max(units - 1, 0).bit_length()  # the smallest power of two >= units
    size = 3 * power // 4 if power >= 4 and 3 * power // 4 >= units else power
    return min(size * multiple, most)


def shared_prefix_length(head: Trajectory, traj: Trajectory) -> int:
    """The tokens `traj` can read from `head` instead of holding them: their common prefix (tokens, and routed
    experts when both carry them: routing replay then computes the prefix with head's), cut so that traj keeps its
    first scored (action or expert) token's predecessor and at least one token."""
    n = min(head.length, traj.length)
    differ = head.tokens[:n] != traj.tokens[:n]
    if head.routed_experts is not None and traj.routed_experts is not None:
        differ |= (head.routed_experts[:n] != traj.routed_experts[:n]).reshape(n, -1).any(axis=1)
    differ = np.flatnonzero(differ)
    common = int(differ[0]) if differ.size else n
    scored = np.flatnonzero(traj.action_mask | traj.expert_mask)
    first_scored = int(scored[0]) if scored.size else traj.length
    return max(0, min(common, first_scored - 1, traj.length - 1))


def pack_batch(
    trajs: Sequence[Trajectory],
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    pad_id: int = 0,
    row_multiple: int = 1,
    share_prefix: bool = False,
) -> tuple[TrajectoryBatch, np.ndarray]:
    """Validates and packs trajectories into rows of T = the bucket >= the longest trajectory whose rows hold the
    fewest positions (B x T; ties: the shorter bucket), several per row (first_fit_decreasing), as a TrajectoryBatch
    with segment_ids: a longer row can take two trajectories where the shortest bucket holds one. Returns it and
    slots int32[B, S], the index into `trajs` of the trajectory in each slot (-1 unused).

    B = packed_row_count(bins, row_multiple, len(trajs) rounded up to row_multiple): the microbatches and the
    data-parallel devices split B, and the rows beyond the bins are empty (all padding). S = the most
    trajectories in one row, rounded up to a power of two (fewer distinct shapes).

    share_prefix: a trajectory after a row's first holds only what it does not share with it
    (shared_prefix_length; TrajectoryBatch.prefix_segment_ids): longer rows share one prefix among more
    trajectories."""
    shortest = _bucket(trajs, buckets)
    most = -(-len(trajs) // row_multiple) * row_multiple

    @functools.cache  # the same pairs recur for every candidate bucket
    def share(first: int, i: int) -> int:
        return shared_prefix_length(trajs[first], trajs[i])

    def layout(T: int) -> list[list[int]]:
        rows = first_fit_decreasing([tr.length for tr in trajs], T, share if share_prefix else None)
        return rows + [[] for _ in range(packed_row_count(len(rows), row_multiple, most) - len(rows))]

    candidates = sorted(b for b in buckets if b >= shortest)
    T, rows = min(((b, layout(b)) for b in candidates), key=lambda c: (len(c[1]) * c[0], c[0]))
    shared = [[0] + [share(r[0], i) for i in r[1:]] for r in rows] if share_prefix else None
    num_slots = 1 << (max(len(r) for r in rows) - 1).bit_length()
    slots = np.full((len(rows), num_slots), -1, np.int32)
    for r, members in enumerate(rows):
        slots[r, : len(members)] = members
    return _fill_rows(trajs, rows, T, pad_id, num_slots, shared), slots


def _fill_rows(
    trajs: Sequence[Trajectory],
    rows: Sequence[Sequence[int]],
    T: int,
    pad_id: int,
    num_slots: int | None,
    shared: Sequence[Sequence[int]] | None = None,
) -> TrajectoryBatch:
    """The TrajectoryBatch whose row r holds trajs[j] for j in rows[r], left to right. num_slots None: one
    trajectory per row ([B] per-trajectory fields, no segment ids); else packed rows with [B, num_slots] fields.
    shared[r][s]: the tokens member s of row r reads from the row's first trajectory instead of holding them."""
    B = len(rows)
    tokens = np.full((B, T), pad_id, np.int32)
    attention = np.zeros((B, T), bool)
    positions = np.zeros((B, T), np.int32)
    action = np.zeros((B, T), bool)
    behavior = np.zeros((B, T), np.float32)
    chunks = np.full((B, T), -1, np.int32)
    expert = np.zeros((B, T), bool)
    segments = np.zeros((B, T), np.int32)
    prefix_segments = np.zeros((B, T), np.int32)
    has_routes = [tr.routed_experts is not None for tr in trajs]
    if any(has_routes) and not all(has_routes):
        uid = trajs[has_routes.index(False)].uid
        raise ValueError(f"trajectory {uid!r}: field 'routed_experts': missing while other trajectories have it")
    routes = None
    if all(has_routes):
        L, k = trajs[0].routed_experts.shape[1:]
        for tr in trajs:
            if tr.routed_experts.shape[1:] != (L, k):
                raise ValueError(
                    f"trajectory {tr.uid!r}: field 'routed_experts': shape {tr.routed_experts.shape} "
                    f"does not match [T, {L}, {k}] of the other trajectories"
                )
        routes = np.zeros((B, T, L, k), np.int32)
    branched = any(tr.chunk_advantages is not None for tr in trajs)
    branch_adv = np.zeros((B, T), np.float32) if branched else None
    branch_mask = np.zeros((B, T), bool) if branched else None
    group_of: dict[str, int] = {}
    groups = [group_of.setdefault(group_key(tr), len(group_of)) for tr in trajs]
    per_trajectory = (B,) if num_slots is None else (B, num_slots)
    rewards = np.zeros(per_trajectory, np.float32)
    group_ids = np.full(per_trajectory, -1, np.int32)
    versions = np.full(per_trajectory, -1, np.int32)
    truncated = np.zeros(per_trajectory, bool)
    for r, members in enumerate(rows):
        start = first_chunk = 0
        for s, j in enumerate(members):
            tr = trajs[j]
            skip = 0 if shared is None else shared[r][s]
            held = slice(skip, tr.length)  # what the row holds of the trajectory
            span = slice(start, start + tr.length - skip)
            tokens[r, span] = tr.tokens[held]
            attention[r, span] = True
            positions[r, span] = np.arange(skip, tr.length)
            action[r, span] = tr.action_mask[held]
            behavior[r, span] = tr.behavior_logprobs[held]
            chunks[r, span] = np.where(tr.action_mask, tr.chunk_ids + first_chunk, -1)[held]
            expert[r, span] = tr.expert_mask[held]
            segments[r, span] = s + 1
            if skip:
                prefix_segments[r, span] = 1
            if routes is not None:
                routes[r, span] = tr.routed_experts[held]
            if tr.chunk_advantages is not None and tr.num_chunks:
                branch_adv[r, span] = np.where(tr.action_mask, tr.chunk_advantages[tr.chunk_ids], 0)[held]
                branch_mask[r, span] = tr.action_mask[held]
            slot = r if num_slots is None else (r, s)
            rewards[slot], group_ids[slot], versions[slot] = tr.reward, groups[j], tr.policy_version
            truncated[slot] = tr.truncated
            start += tr.length - skip
            first_chunk += tr.num_chunks
        # padding continues the count in a one-per-row batch and restarts (a run of its own) in a packed one
        positions[r, start:] = np.arange(T - start) + (start if num_slots is None else 0)
    return TrajectoryBatch(
        tokens=tokens,
        attention_mask=attention,
        positions=positions,
        action_mask=action,
        behavior_logprobs=behavior,
        chunk_ids=chunks,
        expert_mask=expert,
        rewards=rewards,
        group_ids=group_ids,
        policy_versions=versions,
        routed_experts=routes,
        segment_ids=None if num_slots is None else segments,
        branch_advantages=branch_adv,
        branch_mask=branch_mask,
        truncated=truncated,
        prefix_segment_ids=None if shared is None else prefix_segments,
    )
