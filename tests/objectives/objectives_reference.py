"""Independent float64 NumPy reference of the composed objective, written row by row from the formulas in docs/design.md
(no code shared with ipa_jax.objectives)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

EPS = 1e-6


@dataclass
class Reference:
    loss: float
    num_rl: float
    den_rl: float
    num_il: float
    den_il: float
    grad: np.ndarray  # d loss / d l, [B, T]
    weights: np.ndarray  # w = keep * rho * G, [B, T]
    returns: np.ndarray  # G, [B, T]
    chunk_ratios: np.ndarray  # exp(mean over chunk of l - b), [B, T]
    sequence_kl: np.ndarray  # [B]
    admitted: np.ndarray  # [B] bool
    retained: np.ndarray  # [B] int
    keep: np.ndarray  # [B, T] bool, tokens with a nonzero mask
    kl: np.ndarray  # [B, T] Bernoulli KL proxy on action tokens
    acceptance_rate: float  # admitted rows (chunks at chunk level) / rows (chunks)
    scale_magnitude: float  # sum of |loss contributions| (the size float32 round-off is relative to)
    negatives: np.ndarray  # [B] bool, the rows the policy ratio applies to under is_apply_to="negatives"
    mismatch_ratio: np.ndarray  # [B, T] the mismatch ratio at its level on action tokens
    mismatch_dropped: int  # action tokens dropped by the mismatch range mask or the probability-difference filter
    mismatch_capped: int  # kept tokens whose mismatch weight was capped
    clipped: int  # kept tokens whose policy ratio was truncated


def advantages(rewards, baseline, group_ids=None, rl_rows=None):
    """Baselines over the rows with actions (rl_rows, default all); other rows get 0."""
    r = np.asarray(rewards, np.float64)
    rl = np.ones(len(r), bool) if rl_rows is None else np.asarray(rl_rows, bool)
    if baseline == "none":
        out = r.copy()
    elif baseline == "batch_mean":
        out = r - r[rl].mean() if rl.any() else r.copy()
    else:
        g = np.asarray(group_ids)
        out = np.array([r[i] - r[(g == g[i]) & rl].mean() if rl[i] else 0.0 for i in range(len(r))])
    return np.where(rl, out, 0.0)


def row_returns(credit, gamma, advantage, ck):
    """One row's discounted returns G from its advantage (ck: its action tokens' chunk ids 0..K-1)."""
    n = len(ck)
    if credit == "chunk":
        return gamma ** (ck.max() + 1 - 1 - ck) * advantage
    if credit == "token":
        return gamma ** (n - 1 - np.arange(n)) * advantage
    return np.full(n, float(advantage))


def return_baselines(credit, gamma, baseline, values, action, chunk_ids, group_ids=None):
    """baseline_stage "return": b_i = the mean of the returns of the scored units (one value per chunk for chunk
    credit, per action token for token credit, per row for trajectory credit) of every row (batch_mean), of the rows
    of i's group (group_mean), or of the other rows of i's group (rloo; 0 when they have no unit). values: the
    rows' undiscounted R_i. Rows without actions get 0."""
    units = []
    for i in range(len(values)):
        acts = np.flatnonzero(action[i])
        if len(acts) == 0:
            units.append([])
            continue
        ck = chunk_ids[i, acts] if chunk_ids is not None else np.zeros(len(acts), int)
        G = row_returns(credit, gamma, values[i], ck)
        if credit == "chunk":
            units.append([G[ck == k][0] for k in range(ck.max() + 1)])
        elif credit == "token":
            units.append(list(G))
        else:
            units.append([G[0]])
    out = np.zeros(len(values))
    for i in range(len(values)):
        if baseline == "batch_mean":
            pool = range(len(values))
        else:
            pool = [j for j in range(len(values)) if group_ids[j] == group_ids[i] and (baseline != "rloo" or j != i)]
        pooled = [u for j in pool for u in units[j]]
        out[i] = np.mean(pooled) if pooled and units[i] else 0.0
    return out


def bernoulli_kl(b, l):
    p = np.clip(np.exp(b), EPS, 1 - EPS)
    q = np.clip(np.exp(l), EPS, 1 - EPS)
    return p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))


def at_level(v, ck, level):
    """A row's token values v [n] -> the mean over each token's unit at `level` (ck: the tokens' chunk ids)."""
    return {
        "none": np.zeros(len(v)),
        "token": v,
        "chunk": np.array([v[ck == k].mean() for k in ck]),
        "sequence": np.full(len(v), v.mean()),
    }[level]


def reference(cfg, l, b, rewards, action, chunk_ids, expert, group_ids=None, entropies=None, failures=None, old=None):
    """Policy ratio l / p and mismatch ratio q / b: p = q = old when given, else p = b, q = l."""
    l = np.asarray(l, np.float64)
    b = np.asarray(b, np.float64)
    o = None if old is None else np.asarray(old, np.float64)
    B, T = l.shape
    after_discount = cfg.baseline_stage == "return"
    rl_rows = np.asarray(action).any(axis=1)
    adv = cfg.advantage_sign * advantages(rewards, "none" if after_discount else cfg.baseline, group_ids, rl_rows)
    base = np.zeros(B)
    if after_discount:
        base = return_baselines(cfg.credit, cfg.gamma, cfg.baseline, adv, action, chunk_ids, group_ids)
    # a row's own advantage: its last unit's credit, R_i - b_i after discounting
    negatives = adv - base < 0 if cfg.sign_by == "advantage" else np.asarray(rewards, np.float64) <= 0
    out = {k: np.zeros((B, T)) for k in ("weights", "returns", "chunk_ratios", "scale", "mismatch_ratio")}
    seq_kl, admitted, retained = np.zeros(B), np.ones(B, bool), np.zeros(B, int)
    keep_all, kl_all = np.zeros((B, T), bool), np.zeros((B, T))
    rows_with_actions, chunks, chunks_admitted = 0, 0, 0
    counts = {"dropped": 0, "capped": 0, "clipped": 0}
    for i in range(B):
        acts = np.flatnonzero(action[i])
        n = len(acts)
        if n == 0:
            continue
        rows_with_actions += 1
        ck = chunk_ids[i, acts] if chunk_ids is not None else np.zeros(n, int)
        K = ck.max() + 1
        proximal = b[i, acts] if o is None else o[i, acts]
        learner = l[i, acts] if o is None else o[i, acts]

        G = row_returns(cfg.credit, cfg.gamma, adv[i], ck) - base[i]
        # after discounting, each token is a negative iff its own credit is
        token_negatives = G < 0 if after_discount and cfg.sign_by == "advantage" else np.full(n, negatives[i])
        d = bernoulli_kl(proximal, l[i, acts])
        seq_kl[i] = max(d.mean(), 0.0)
        keep = np.ones(n, bool)
        if cfg.trust_region_level == "sequence":
            admitted[i] = seq_kl[i] <= cfg.trust_region_delta
            keep &= admitted[i]
        elif cfg.trust_region_level == "chunk":
            chunk_d = np.array([max(d[ck == k].mean(), 0.0) for k in ck])
            keep &= chunk_d <= cfg.trust_region_delta
            admitted[i] = keep.all()
            chunks_admitted += sum(bool(keep[ck == k][0]) for k in range(K))
        chunks += K
        mismatch = np.exp(at_level(learner - b[i, acts], ck, cfg.mismatch_level))
        mismatch_keep = np.ones(n, bool)
        if cfg.mismatch_level != "none":
            mismatch_keep &= (mismatch >= cfg.mismatch_range[0]) & (mismatch <= cfg.mismatch_range[1])
            prob_diff = at_level(np.exp(learner) - np.exp(b[i, acts]), ck, cfg.mismatch_level)
            mismatch_keep &= np.abs(prob_diff) <= cfg.mismatch_prob_diff
        counts["dropped"] += int((~mismatch_keep).sum())
        keep &= mismatch_keep
        is_failure = negatives[i] if failures is None else failures[i]
        if cfg.negative_token_fraction < 1 and is_failure:
            k_keep = math.ceil(Fraction(str(cfg.negative_token_fraction)) * n)
            order = np.argsort(-np.asarray(entropies[i, acts], np.float64), kind="stable")
            top = np.zeros(n, bool)
            top[order[:k_keep]] = True
            keep &= top
        applies = token_negatives | (cfg.is_apply_to == "all")  # positives keep rho = 1 under "negatives"
        rho = np.where(applies, np.exp(at_level(l[i, acts] - proximal, ck, cfg.is_level)), 1.0)
        if cfg.is_clip_max is not None:
            counts["clipped"] += int((keep & applies & (rho > cfg.is_clip_max)).sum())
            rho = np.where(applies, np.minimum(rho, cfg.is_clip_max), rho)
        capped = mismatch > cfg.mismatch_is_cap
        counts["capped"] += int((keep & capped).sum())
        c = np.minimum(mismatch, cfg.mismatch_is_cap) if math.isfinite(cfg.mismatch_is_cap) else np.ones(n)
        w = np.where(keep, rho * c * G, 0.0)
        if cfg.aggregation == "sample_mean":
            scale = np.full(n, 1.0 / (max(keep.sum(), 1) if cfg.row_denominator == "kept" else n))
        elif cfg.aggregation == "chunk_mean":
            scale = np.array([1.0 / (K * (ck == k).sum()) for k in ck])
        else:
            scale = np.ones(n)
        out["weights"][i, acts] = w
        out["returns"][i, acts] = G
        out["chunk_ratios"][i, acts] = np.exp(at_level(l[i, acts] - b[i, acts], ck, "chunk"))
        out["scale"][i, acts] = scale
        out["mismatch_ratio"][i, acts] = mismatch
        retained[i] = keep.sum()
        keep_all[i, acts], kl_all[i, acts] = keep, d
    den_rl = float(action.sum()) if cfg.aggregation == "token_mean" else float(rows_with_actions)
    num_rl = -np.sum(out["weights"] * out["scale"] * np.where(action, l, 0))
    ex = np.zeros((B, T), bool) if expert is None else np.asarray(expert, bool)
    num_il, den_il = -np.sum(np.where(ex, l, 0)), float(ex.sum())
    loss = cfg.rl_weight * num_rl / max(den_rl, 1)
    grad = -cfg.rl_weight * out["weights"] * out["scale"] / max(den_rl, 1)
    magnitude = cfg.rl_weight * np.sum(np.abs(out["weights"] * out["scale"] * l)) / max(den_rl, 1)
    if cfg.il_weight != 0:
        loss += cfg.il_weight * num_il / max(den_il, 1)
        grad = grad - cfg.il_weight * ex / max(den_il, 1)
        magnitude += abs(cfg.il_weight) * np.sum(np.abs(np.where(ex, l, 0))) / max(den_il, 1)
    acceptance = {"none": 1.0, "sequence": admitted[action.any(1)].mean(), "chunk": chunks_admitted / max(chunks, 1)}[
        cfg.trust_region_level
    ]
    return Reference(
        keep=keep_all,
        kl=kl_all,
        acceptance_rate=acceptance,
        loss=loss,
        num_rl=num_rl,
        den_rl=den_rl,
        num_il=num_il,
        den_il=den_il,
        grad=grad,
        weights=out["weights"],
        returns=out["returns"],
        chunk_ratios=out["chunk_ratios"],
        sequence_kl=seq_kl,
        admitted=admitted,
        retained=retained,
        scale_magnitude=magnitude,
        negatives=negatives,
        mismatch_ratio=out["mismatch_ratio"],
        mismatch_dropped=counts["dropped"],
        mismatch_capped=counts["capped"],
        clipped=counts["clipped"],
    )


def random_batch(
    rng: np.random.Generator, B: int = 4, T: int = 32, drift: float | None = None, expert_fraction: float = 0.3
) -> dict[str, np.ndarray]:
    """Ragged rows: prompt, then alternating action turns (one chunk each) and observations, then padding.
    Some prompt tokens are expert targets. drift = scale of b - l (random per row when None)."""
    action = np.zeros((B, T), bool)
    chunk_ids = np.full((B, T), -1, np.int32)
    expert = np.zeros((B, T), bool)
    for i in range(B):
        length = int(rng.integers(4, T + 1))
        prompt = int(rng.integers(1, max(2, length // 3)))
        expert[i, 1:prompt] = rng.random(prompt - 1) < expert_fraction
        t, k = prompt, 0
        while t < length:
            turn = int(rng.integers(1, 6))
            action[i, t : min(t + turn, length)] = True
            chunk_ids[i, t : min(t + turn, length)] = k
            k += 1
            t += turn + int(rng.integers(0, 4))  # observation tokens between turns
    l = np.where(action, -rng.exponential(1.5, (B, T)), 0.0)
    scale = rng.choice([0.005, 0.05, 0.5, 2.0], size=(B, 1)) if drift is None else drift
    b = np.where(action, -np.abs(l + scale * rng.standard_normal((B, T))), 0.0)
    return {
        "log_probs": l.astype(np.float32),
        "behavior_log_probs": b.astype(np.float32),
        "rewards": rng.choice([0.0, 1.0, -0.5, 2.0], size=B).astype(np.float32),
        "action_mask": action,
        "chunk_ids": chunk_ids,
        "expert_mask": expert,
        "group_ids": rng.integers(0, 2, size=B).astype(np.int32),
        "entropies": rng.uniform(0, 5, (B, T)).astype(np.float32),
    }
