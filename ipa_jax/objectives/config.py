"""ObjectiveConfig: every switch of the composed objective (docs/design.md, "The objective"), validated on creation.

Frozen and hashable, so it can be a static argument of jax.jit. Defaults are IPA as published (chunk credit
gamma 0.95, no baseline, chunk ratio applied to negatives truncated at 1, chunk mismatch mask [0, 5], no trust
region, sample-mean, one ratio against the behaviour log-probs); the published settings are the presets in
presets.py (docs/off_policy.md says which source each reproduces).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

BASELINES = ("none", "batch_mean", "group_mean", "rloo")
BASELINE_STAGES = ("reward", "return")
ADVANTAGE_NORMS = ("none", "group_std", "batch_std")
GROUP_OF_ONE = ("zero", "reward")
SURROGATES = ("reinforce", "ppo")
CREDITS = ("chunk", "token", "trajectory", "branch")
IS_LEVELS = ("none", "token", "chunk", "sequence")
IS_APPLY_TO = ("all", "negatives")
MISMATCH_LEVELS = ("none", "token", "chunk", "sequence")
TRUST_REGION_LEVELS = ("none", "sequence", "chunk")
AGGREGATIONS = ("sample_mean", "token_mean", "chunk_mean", "sequence_sum", "token_sum_norm")
IL_AGGREGATIONS = ("token_mean", "sample_mean")
OLD_LOGPROBS = ("behavior", "recompute")
SIGN_BY = ("advantage", "reward")
ROW_DENOMINATORS = ("action", "kept")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class ObjectiveConfig:
    """Every switch of the composed objective (one line per field; the first sentence is its help text).

    baseline: advantage A_i = R_i - baseline: "none" (IPA), "batch_mean" (FlashREINFORCE), "group_mean" (GRPO)
      or "rloo" (the mean of the other samples of the group: RLOO).
    baseline_stage: where the baseline is subtracted: "reward" (A_i = R_i - b, then discounted: every chunk of an
      episode has its sign) or "return" (after discounting, G_{i,t} - b with b the baseline's mean of the
      discounted returns over the scored units: an early chunk of a success can be negative; docs/objectives.md).
    advantage_norm: then divide A by a std: "none", "group_std" (the group's reward std: GRPO) or "batch_std"
      (whiten over the batch's action tokens, (A - mean) / std: REINFORCE++).
    group_of_one: baseline "group_mean", a trajectory alone in its group (the others filtered out, or offline
      data): "zero" (A = 0: its own reward is its group's mean, nothing to compare with) or "reward" (verl's GRPO:
      the group's mean taken as 0 and its std as 1, A = R, / (1 + eps) with group_std).
    advantage_eps: the epsilon of advantage_norm's divisor, std + eps.
    advantage_sign: +1, or -1 for a control that flips every advantage (it must learn to fail: a positive control).
    credit: the unit sharing one discounted return: "chunk" (IPA), "token" or "trajectory" (FlashREINFORCE); or
      "branch": each chunk's Monte Carlo advantage V(k+1) - V(k) from branched continuations (rollout/branch.py),
      undiscounted and from raw rewards (no kl_penalty, overlong punishment or advantage_norm with it); gamma and
      the baseline apply to the episodes left unbranched, which get chunk credit.
    branch_samples: credit "branch": continuations sampled from the state before each chunk (n per V(k)).
    branch_fraction: credit "branch": the fraction of episodes branched, in (0, 1]; the others get chunk credit.
    gamma: discount in (0, 1] per chunk (chunk credit) or per action token (token credit); with credit "branch",
      of the unbranched episodes' chunk credit (a branched chunk's V(k+1) - V(k) is a one-step difference).
    old_logprobs: the policy ratio's denominator: "behavior" (the sampler's) or "recompute" (the learner's).
      "recompute": the caller passes old_log_probs, the learner's log-probs at the start of the update; the
      policy ratio (rho, trust region) is then current vs old and the mismatch ratio old vs behaviour.
    is_level: level of the stop-gradient importance ratio rho: "none", "token", "chunk" or "sequence".
    is_apply_to: which samples rho weights: "all", or "negatives" (TOPR/IPA; the rows sign_by says are negative).
    sign_by: which rows are negatives: "advantage" (A_i < 0) or "reward" (R_i <= 0, the ROME paper's and ROLL's).
    is_clip_max: truncate rho at this value (TOPR and ROLL: 1; the ROME paper's pseudo-code: 10); None (inf) = never.
    mismatch_level: level of the mismatch ratio (old vs behaviour): "none", "token", "chunk" or "sequence".
      "none" turns off every mismatch correction (range mask, probability-difference filter, capped weight).
    mismatch_range: (low, high): keep tokens whose mismatch ratio lies in [low, high].
    mismatch_is_cap: weight kept tokens by min(mismatch ratio, cap) (ROLL: 1.2); inf (or None) = no weight.
    mismatch_prob_diff: drop tokens whose level mean of exp(old) - exp(b) exceeds this in absolute value; inf = off.
    trust_region_level: Bernoulli-KL trust region: "none", "sequence" (FlashREINFORCE) or "chunk".
    trust_region_delta: admit a sequence (chunk) iff its mean Bernoulli-KL D <= delta; inf disables it.
    negative_token_fraction: q in [0, 1]: failed trajectories keep their ceil(q T_i) highest-entropy tokens.
    aggregation: how token terms are averaged: "sample_mean", "token_mean", "chunk_mean", "sequence_sum" or
      "token_sum_norm" (token sums over a constant, rows x norm_length: Dr.GRPO).
    norm_length: token_sum_norm's constant L (the generation budget in tokens); 0 with any other aggregation.
    surrogate: the policy-gradient term's form: "reinforce" (-w l, w stop-gradient) or "ppo" (clipped ratio).
    ppo_clip_low: PPO clips the ratio current / old to [1 - ppo_clip_low, 1 + ppo_clip_high].
    ppo_clip_high: the upper clip of the ratio (DAPO's clip-higher: > ppo_clip_low).
    ppo_dual_clip: dual-clip constant c > 1 bounding the loss of negative advantages at -c A; inf = off (verl
      always applies c = 3: set 3 to match it; docs/objectives.md, "Differences from verl").
    ppo_log_ratio_clamp: the ppo surrogate's log-ratio is clamped to [-c, c] before exp (verl: 20), so that its
      loss stays finite in float32 (exp overflows past 88.7); a token beyond the clamp carries no gradient; inf
      (or None) = off.
    row_denominator: sample_mean's per-row divisor: "action" (T_i, FlashREINFORCE) or "kept" (kept tokens, ROLL).
    rl_weight: lambda_RL, the weight of the RL term.
    il_weight: lambda_IL, the weight of the imitation (NLL on expert tokens) term.
    il_aggregation: how the imitation term averages: "token_mean" (over expert tokens) or "sample_mean" (over
      imitated sequences, each its token mean: the RL term's sample_mean). The RL phase's: the IL warm start
      always averages over expert tokens (pipeline.build.warm_start_objective).
    entropy_weight: the weight of the entropy bonus -Agg(H) over action tokens (> 0 raises entropy); 0 = off.
    kl_weight: the weight of the KL loss term Agg(k) against the frozen reference policy (model.reference); 0 = off.
    kl_estimator: the KL loss term's per-token estimator: "k1", "k2" or "k3" (Schulman's; objectives/kl.py).
    kl_penalty: beta of the KL reward penalty R_i - beta * sum_t k_t (behaviour vs reference log-probs: see
      kl_penalty_logprobs); 0 = off.
    kl_penalty_estimator: the KL reward penalty's per-token estimator: "k1", "k2" or "k3".
    kl_penalty_logprobs: the policy side of the penalty's k_t: "behavior" (the sampler's, the policy that drew
      the tokens, whose KL k1 estimates) or "recompute" (verl's: the learner's old log-probs, old_logprobs
      "recompute"'s; a batch's first update then costs one more forward).
    overlong_max_length: DAPO's L_max in action tokens for the soft overlong punishment; 0 = off.
    overlong_buffer_length: DAPO's L_cache: the punishment ramps from 0 to -overlong_penalty over the last
      L_cache tokens before overlong_max_length.
    overlong_penalty: the largest punishment added to the reward (DAPO: 1).
    overlong_filter: mask truncated episodes (finish reason length or context) out of the loss (DAPO).
    """

    baseline: str = "none"
    baseline_stage: str = "reward"
    advantage_norm: str = "none"
    group_of_one: str = "zero"
    advantage_eps: float = 1e-6
    advantage_sign: int = 1
    credit: str = "chunk"
    gamma: float = 0.95
    old_logprobs: str = "behavior"
    is_level: str = "chunk"
    is_apply_to: str = "negatives"
    sign_by: str = "advantage"
    is_clip_max: float | None = 1.0
    mismatch_level: str = "chunk"
    mismatch_range: tuple[float, float] = (0.0, 5.0)
    mismatch_is_cap: float = math.inf
    mismatch_prob_diff: float = math.inf
    trust_region_level: str = "none"
    trust_region_delta: float = 3e-3
    negative_token_fraction: float = 1.0
    aggregation: str = "sample_mean"
    row_denominator: str = "action"
    norm_length: int = 0
    surrogate: str = "reinforce"
    ppo_clip_low: float = 0.2
    ppo_clip_high: float = 0.2
    ppo_dual_clip: float = math.inf
    ppo_log_ratio_clamp: float = 20.0
    rl_weight: float = 1.0
    il_weight: float = 1.0
    il_aggregation: str = "token_mean"
    branch_samples: int = 4
    branch_fraction: float = 1.0
    entropy_weight: float = 0.0
    kl_weight: float = 0.0
    kl_estimator: str = "k3"
    kl_penalty: float = 0.0
    kl_penalty_estimator: str = "k1"
    kl_penalty_logprobs: str = "behavior"
    overlong_max_length: int = 0
    overlong_buffer_length: int = 0
    overlong_penalty: float = 1.0
    overlong_filter: bool = False

    def __post_init__(self) -> None:
        for name, choices in (
            ("baseline", BASELINES),
            ("baseline_stage", BASELINE_STAGES),
            ("advantage_norm", ADVANTAGE_NORMS),
            ("group_of_one", GROUP_OF_ONE),
            ("surrogate", SURROGATES),
            ("credit", CREDITS),
            ("old_logprobs", OLD_LOGPROBS),
            ("is_level", IS_LEVELS),
            ("is_apply_to", IS_APPLY_TO),
            ("sign_by", SIGN_BY),
            ("mismatch_level", MISMATCH_LEVELS),
            ("trust_region_level", TRUST_REGION_LEVELS),
            ("aggregation", AGGREGATIONS),
            ("row_denominator", ROW_DENOMINATORS),
            ("il_aggregation", IL_AGGREGATIONS),
            ("kl_estimator", KL_ESTIMATORS),
            ("kl_penalty_estimator", KL_ESTIMATORS),
            ("kl_penalty_logprobs", OLD_LOGPROBS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"ObjectiveConfig.{name}: {getattr(self, name)!r} is not one of {choices}")
        if self.advantage_sign not in (1, -1) or isinstance(self.advantage_sign, bool):
            raise ValueError(f"ObjectiveConfig.advantage_sign: must be 1 or -1, got {self.advantage_sign!r}")
        object.__setattr__(self, "advantage_sign", int(self.advantage_sign))
        if not _number(self.gamma) or not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"ObjectiveConfig.gamma: must be in (0, 1], got {self.gamma!r}")
        if self.is_clip_max is not None and (not _number(self.is_clip_max) or not self.is_clip_max > 0):
            raise ValueError(f"ObjectiveConfig.is_clip_max: must be None or > 0, got {self.is_clip_max!r}")
        # A list (e.g. from a ConfigDict) would make the config unhashable: store a tuple.
        rng = tuple(self.mismatch_range) if isinstance(self.mismatch_range, (tuple, list)) else None
        if rng is None or len(rng) != 2 or not all(_number(x) for x in rng) or not 0.0 <= rng[0] <= rng[1]:
            raise ValueError(
                f"ObjectiveConfig.mismatch_range: must be (low, high) with 0 <= low <= high, "
                f"got {self.mismatch_range!r}"
            )
        object.__setattr__(self, "mismatch_range", (float(rng[0]), float(rng[1])))
        # None is the Python spelling of "off"; the stored value is inf, so that the field stays a float.
        for name, lowest in (("mismatch_is_cap", "> 0"), ("mismatch_prob_diff", ">= 0")):
            value = math.inf if getattr(self, name) is None else getattr(self, name)
            if not _number(value) or not (value > 0 if lowest == "> 0" else value >= 0):  # also rejects NaN
                raise ValueError(f"ObjectiveConfig.{name}: must be {lowest} (inf or None = off), got {value!r}")
            if math.isfinite(value) and self.mismatch_level == "none":
                raise ValueError(f"ObjectiveConfig.{name}: a mismatch correction needs mismatch_level != 'none'")
            object.__setattr__(self, name, float(value))
        if self.row_denominator == "kept" and self.aggregation != "sample_mean":
            raise ValueError(
                f"ObjectiveConfig.row_denominator: 'kept' divides each row of sample_mean by its kept "
                f"tokens; aggregation {self.aggregation!r} has no per-row token count"
            )
        if not _number(self.trust_region_delta) or not self.trust_region_delta >= 0:  # also rejects NaN
            raise ValueError(
                f"ObjectiveConfig.trust_region_delta: must be >= 0 (inf disables the trust region), "
                f"got {self.trust_region_delta!r}"
            )
        if not _number(self.negative_token_fraction) or not 0.0 <= self.negative_token_fraction <= 1.0:
            raise ValueError(
                f"ObjectiveConfig.negative_token_fraction: must be in [0, 1], got {self.negative_token_fraction!r}"
            )
        if isinstance(self.branch_samples, bool) or not isinstance(self.branch_samples, int) or self.branch_samples < 1:
            raise ValueError(f"ObjectiveConfig.branch_samples: must be an int >= 1, got {self.branch_samples!r}")
        if not _number(self.branch_fraction) or not 0.0 < self.branch_fraction <= 1.0:
            raise ValueError(f"ObjectiveConfig.branch_fraction: must be in (0, 1], got {self.branch_fraction!r}")
        for name in ("rl_weight", "il_weight", "entropy_weight", "kl_weight"):
            if not _number(getattr(self, name)) or not math.isfinite(getattr(self, name)):
                raise ValueError(f"ObjectiveConfig.{name}: must be a finite number, got {getattr(self, name)!r}")
        if not _number(self.kl_penalty) or not 0.0 <= self.kl_penalty < math.inf:  # also rejects NaN
            raise ValueError(
                f"ObjectiveConfig.kl_penalty: must be a finite number >= 0 (0 = off), got {self.kl_penalty!r}"
            )
        if self.kl_penalty_logprobs == "recompute" and (self.kl_penalty == 0 or not self.needs_old_log_probs):
            raise ValueError(
                "ObjectiveConfig.kl_penalty_logprobs: 'recompute' takes the KL reward penalty's log-probs from the "
                "learner's old log-probs: needs kl_penalty > 0 and old_logprobs 'recompute'"
            )
        self._check_estimator()
        self._check_surrogate()
        self._check_overlong()
        self._check_branch()

    def _check_estimator(self) -> None:
        if not _number(self.advantage_eps) or not self.advantage_eps > 0 or not math.isfinite(self.advantage_eps):
            raise ValueError(f"ObjectiveConfig.advantage_eps: must be a finite number > 0, got {self.advantage_eps!r}")
        if self.advantage_norm == "group_std" and self.baseline not in ("group_mean", "rloo"):
            raise ValueError(
                f"ObjectiveConfig.advantage_norm: 'group_std' divides a group baseline's advantages by the group's "
                f"std; baseline {self.baseline!r} has no groups (use 'group_mean' or 'rloo')"
            )
        if self.group_of_one != "zero" and (self.baseline != "group_mean" or self.baseline_stage != "reward"):
            raise ValueError(
                f"ObjectiveConfig.group_of_one: {self.group_of_one!r} sets the advantage of a group of one under "
                f"baseline 'group_mean' at stage 'reward', got baseline {self.baseline!r} at stage "
                f"{self.baseline_stage!r} (rloo's group of one always has A = R)"
            )
        self._check_baseline_stage()
        if not _integer(self.norm_length) or self.norm_length < 0:
            raise ValueError(f"ObjectiveConfig.norm_length: must be an integer >= 0, got {self.norm_length!r}")
        if (self.aggregation == "token_sum_norm") != (self.norm_length > 0):
            raise ValueError(
                f"ObjectiveConfig.norm_length: must be > 0 exactly with aggregation 'token_sum_norm' (its constant "
                f"normaliser), got {self.norm_length!r} with aggregation {self.aggregation!r}"
            )

    def _check_baseline_stage(self) -> None:
        if self.baseline_stage == "reward":
            return
        prefix = "ObjectiveConfig.baseline_stage: 'return' subtracts the baseline from the discounted returns;"
        if self.baseline == "none":
            raise ValueError(f"{prefix} baseline 'none' has none to subtract (set a baseline, or stage 'reward')")
        if self.advantage_norm != "none":
            raise ValueError(
                f"{prefix} advantage_norm {self.advantage_norm!r} divides per-sequence advantages by a reward std, "
                f"which is not defined on per-token returns (use advantage_norm 'none')"
            )
        if self.credit == "branch":
            raise ValueError(
                f"{prefix} credit 'branch' gives branched chunks V(k+1) - V(k), already baselined (use stage 'reward')"
            )

    def _check_surrogate(self) -> None:
        for name in ("ppo_clip_low", "ppo_clip_high"):
            value = getattr(self, name)
            if not _number(value) or not 0 <= value < math.inf or (name == "ppo_clip_low" and value >= 1):
                bound = "[0, 1)" if name == "ppo_clip_low" else "[0, inf)"
                raise ValueError(f"ObjectiveConfig.{name}: must be in {bound}, got {value!r}")
        dual = math.inf if self.ppo_dual_clip is None else self.ppo_dual_clip
        if not _number(dual) or not dual > 1:  # also rejects NaN
            raise ValueError(f"ObjectiveConfig.ppo_dual_clip: must be > 1 (inf or None = off), got {dual!r}")
        object.__setattr__(self, "ppo_dual_clip", float(dual))
        if math.isfinite(dual) and self.surrogate != "ppo":
            raise ValueError("ObjectiveConfig.ppo_dual_clip: the dual clip belongs to the ppo surrogate")
        clamp = math.inf if self.ppo_log_ratio_clamp is None else self.ppo_log_ratio_clamp
        if not _number(clamp) or not clamp > 0:  # also rejects NaN
            raise ValueError(f"ObjectiveConfig.ppo_log_ratio_clamp: must be > 0 (inf or None = off), got {clamp!r}")
        object.__setattr__(self, "ppo_log_ratio_clamp", float(clamp))
        if self.surrogate == "ppo" and self.is_level != "none":
            raise ValueError(
                f"ObjectiveConfig.is_level: the ppo surrogate carries its own ratio (current / old per token); "
                f"the stop-gradient ratio rho must be off (is_level 'none'), got {self.is_level!r}"
            )

    def _check_overlong(self) -> None:
        for name in ("overlong_max_length", "overlong_buffer_length"):
            if not _integer(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"ObjectiveConfig.{name}: must be an integer >= 0, got {getattr(self, name)!r}")
        if self.overlong_max_length > 0 and not 0 < self.overlong_buffer_length <= self.overlong_max_length:
            raise ValueError(
                f"ObjectiveConfig.overlong_buffer_length: must be in (0, overlong_max_length="
                f"{self.overlong_max_length}] when the soft overlong punishment is on, got "
                f"{self.overlong_buffer_length!r}"
            )
        if self.overlong_max_length == 0 and self.overlong_buffer_length != 0:
            raise ValueError("ObjectiveConfig.overlong_buffer_length: needs overlong_max_length > 0")
        if not _number(self.overlong_penalty) or not 0 <= self.overlong_penalty < math.inf:
            raise ValueError(
                f"ObjectiveConfig.overlong_penalty: must be a finite number >= 0, got {self.overlong_penalty!r}"
            )
        if not isinstance(self.overlong_filter, bool):
            raise ValueError(f"ObjectiveConfig.overlong_filter: must be True or False, got {self.overlong_filter!r}")

    def _check_branch(self) -> None:
        """Branch credit takes a branched chunk's advantage V(k+1) - V(k) from the raw rewards of continuations the
        learner never sees: reward shaping of the episode alone would bias it, so the options that shape rewards
        are refused (gamma and the baseline apply to the unbranched episodes' chunk credit only)."""
        if self.credit != "branch":
            return
        prefix = "with credit 'branch', a branched chunk's V(k+1) - V(k) comes from its continuations' raw rewards;"
        for name, on, why in (
            (
                "kl_penalty",
                self.kl_penalty > 0,
                "the continuations' KL to the reference is not known (use the KL loss term, kl_weight)",
            ),
            (
                "overlong_max_length",
                self.overlong_max_length > 0,
                "the continuations' lengths are not punished (use overlong_filter)",
            ),
            (
                "advantage_norm",
                self.advantage_norm != "none",
                "a reward std scales episode advantages, not differences of Monte Carlo values",
            ),
        ):
            if on:
                raise ValueError(f"ObjectiveConfig.{name}: {prefix} {why}")

    @property
    def needs_old_log_probs(self) -> bool:
        """Whether the caller must pass old_log_probs (the learner's log-probs at the start of the update)."""
        return self.old_logprobs == "recompute"

    def check_old_log_probs(self, given: bool) -> None:
        """Raises ValueError unless old_log_probs are given exactly when old_logprobs == "recompute"."""
        if given != self.needs_old_log_probs:
            raise ValueError(
                f"old_log_probs: {'required' if self.needs_old_log_probs else 'must be None'} for "
                f"old_logprobs={self.old_logprobs!r}"
            )

    def check_baselines(self, given: bool) -> None:
        """Raises ValueError unless return baselines are given exactly when baseline_stage == "return"."""
        if given != (self.baseline_stage == "return"):
            raise ValueError(
                f"baselines: {'required' if self.baseline_stage == 'return' else 'must be None'} for "
                f"baseline_stage={self.baseline_stage!r} (estimate_return_baselines on the full batch)"
            )

    @property
    def needs_reference(self) -> bool:
        """Whether the train step needs the reference policy's log-probs (a KL loss term or a KL reward penalty)."""
        return self.kl_weight != 0 or self.kl_penalty > 0

    @property
    def penalty_reads_old_log_probs(self) -> bool:
        """Whether the KL reward penalty reads the old log-probs (kl_penalty_logprobs "recompute")."""
        return self.kl_penalty > 0 and self.kl_penalty_logprobs == "recompute"

    @property
    def needs_rewards(self) -> bool:
        """Whether the caller must pass rewards (negatives are R_i <= 0)."""
        return self.sign_by == "reward"

    @property
    def needs_group_ids(self) -> bool:
        """Whether the caller must pass group_ids (a group baseline)."""
        return self.baseline in ("group_mean", "rloo")

    @property
    def overlong_shaping(self) -> bool:
        """Whether the soft overlong punishment is added to the rewards."""
        return self.overlong_max_length > 0

    @property
    def uses_chunks(self) -> bool:
        """Whether this configuration needs chunk_ids."""
        return (
            "chunk" in (self.credit, self.is_level, self.mismatch_level, self.trust_region_level)
            or self.credit == "branch"
            or self.aggregation == "chunk_mean"
        )
