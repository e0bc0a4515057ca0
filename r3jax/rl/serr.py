"""Structural Entropy Ranking Reward (SERR, R3-SPEC §6): a graded reward for groups that are all wrong.

When every response to a question is wrong, every reward is 0 and the group teaches nothing. SERR ranks the
in-scope responses (truncated ones, by default) by the shape of their token-entropy curve H_t:

    k_i      = max(1, floor(p · L_i))                     L_i = response tokens of i
    E_peak_i = mean of the k_i largest H_t                 local exploration (forking tokens): high is good
    E_glob_i = mean of all H_t                             global stability: low is good
    i ≻ j    iff E_peak_i > E_peak_j and E_glob_i < E_glob_j
    S_i      = #{j : i ≻ j}
    sorted by S_i descending, position k of n gets R_max · (1 - k / (n - 1)); ties share the mean

Everything works on padded, fixed-shape arrays (`[..., T]` tokens, `[..., N]` responses of a group, N = G in
the train step) with no data-dependent shapes, so it runs inside the jitted train step.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import numbers

import jax
import jax.numpy as jnp

from r3jax.rl import masked

SCOPES = ("truncated", "failed")
_MAX_DENOMINATOR = 10_000  # p is read as a fraction a/b with b <= this: exact for decimals with <= 4 places


@dataclasses.dataclass(frozen=True)
class SERRConfig:
    """SERR's knobs (R3-SPEC §6), checked on construction; frozen, so jitted code can close over it.

    p      fraction of a response's tokens whose entropies make up E_peak (DECIDED 0.2), 0 < p <= 1
    r_max  reward of the top-ranked response (DECIDED 0.5, below any correct answer's 1), >= 0
    scope  "truncated": rank the truncated wrong responses, wrong finished ones keep 0 (DECIDED);
           "failed": rank every wrong response
    """

    p: float = 0.2
    r_max: float = 0.5
    scope: str = "truncated"

    def __post_init__(self):
        _peak_fraction(self.p)
        r_max = self.r_max
        if isinstance(r_max, bool) or not isinstance(r_max, numbers.Real) or not (math.isfinite(r_max) and r_max >= 0):
            raise ValueError(f"SERR r_max must be a finite number >= 0, got {self.r_max!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"SERR scope must be one of {SCOPES}, got {self.scope!r}")


def _peak_fraction(p) -> fractions.Fraction:
    """p as an exact fraction, so that floor(p · L) is integer arithmetic (in float32, floor(0.53 · 100) is 52)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
        raise ValueError(f"SERR p must be a number with 0 < p <= 1, got {p!r}")
    return fractions.Fraction(float(p)).limit_denominator(_MAX_DENOMINATOR)


def peak_counts(lengths: jax.Array, p: float = 0.2) -> jax.Array:
    """k = max(1, floor(p · L)) (R3-SPEC §6), in exact integer arithmetic: p = a/b, k = max(1, (a · L) // b).

    `p` is a static Python number; it is read as the nearest fraction with denominator <= 10,000 (exact for
    0.2, 0.15, 0.125, ...). Lengths must stay below 2**31 / a (about 214,000 tokens for any p) for int32."""
    frac = _peak_fraction(p)
    lengths = jnp.asarray(lengths, jnp.int32)
    return jnp.maximum(1, (frac.numerator * lengths) // frac.denominator)


def entropy_features(entropies: jax.Array, mask: jax.Array, p: float = 0.2) -> tuple[jax.Array, jax.Array]:
    """(E_peak, E_glob) of each response (R3-SPEC §6), both `[...]` from `[..., T]` entropies and mask.

    E_peak = mean of the k largest H_t among the response's tokens (k from `peak_counts`), found by a
    descending sort of H with the padding set to -inf and a `rank < k` mask; E_glob = mean of all its H_t.
    A response with no token (L = 0) has 0/0 for both; they are defined as 0 (`serr_rewards` never ranks it).
    """
    if entropies.shape[-1] * _peak_fraction(p).numerator >= 2**31:
        raise ValueError(f"T = {entropies.shape[-1]} tokens overflows int32 in floor(p * L) with p = {p}")
    mask = jnp.asarray(mask, bool)
    lengths = jnp.sum(mask, axis=-1, dtype=jnp.int32)  # [...]
    k = peak_counts(lengths, p)
    descending = jnp.flip(jnp.sort(jnp.where(mask, entropies, -jnp.inf), axis=-1), axis=-1)  # [..., T]
    rank = jnp.arange(entropies.shape[-1])
    # k <= L whenever L >= 1 (p <= 1); `rank < L` only matters for L = 0, where k = 1 would pick a -inf.
    top = (rank < k[..., None]) & (rank < lengths[..., None])  # [..., T]
    return masked.masked_mean(descending, top, axis=-1), masked.masked_mean(entropies, mask, axis=-1)


def dominance_counts(e_peak: jax.Array, e_glob: jax.Array, in_scope: jax.Array) -> jax.Array:
    """S_i = #{j in scope : E_peak_i > E_peak_j and E_glob_i < E_glob_j} (R3-SPEC §6), int32 `[..., N]`.

    Both inequalities are strict, so i never dominates itself nor an exact copy of itself. S_i = 0 for i out
    of scope. Pairwise over the N responses of a group: `[..., N, N]` booleans, tiny for N = G."""
    in_scope = jnp.asarray(in_scope, bool)
    beats = (e_peak[..., :, None] > e_peak[..., None, :]) & (e_glob[..., :, None] < e_glob[..., None, :])  # [..., i, j]
    beats &= in_scope[..., :, None] & in_scope[..., None, :]
    return jnp.sum(beats, axis=-1, dtype=jnp.int32)


def rank_rewards(s: jax.Array, in_scope: jax.Array, r_max: float = 0.5) -> jax.Array:
    """Ranking rewards (R3-SPEC §6), float32 `[..., N]`: position k of n (by S descending) earns
    r_max · (1 - k / (n - 1)); responses with equal S share the mean reward of the positions they occupy.

    No sort: i's tied block occupies the contiguous positions first = #{j in scope: S_j > S_i} through
    last = #{j in scope: S_j >= S_i} - 1, and the reward is linear in k, so the block's mean reward is
    r_max · (1 - (first + last) / 2 / (n - 1)) = r_max · (2(n - 1) - first - last) / (2(n - 1)), kept in
    integers up to the one division so the last place gets exactly 0 (XLA may divide by a reciprocal).
    The in-scope rewards always sum to n · r_max / 2, so a group where all S are equal gets r_max / 2 each.
    n = 1 and out-of-scope responses get 0.
    """
    in_scope = jnp.asarray(in_scope, bool)
    n = jnp.sum(in_scope, axis=-1, keepdims=True, dtype=jnp.int32)  # [..., 1]
    others = in_scope[..., None, :]  # [..., 1, j]
    first = jnp.sum(others & (s[..., None, :] > s[..., :, None]), axis=-1, dtype=jnp.int32)  # [..., i]
    last = jnp.sum(others & (s[..., None, :] >= s[..., :, None]), axis=-1, dtype=jnp.int32) - 1
    above_bottom = 2 * (n - 1) - first - last  # twice the mean distance from the last position
    rewards = r_max * (above_bottom / (2 * jnp.maximum(n - 1, 1)))
    return jnp.where(in_scope & (n > 1), rewards, 0.0).astype(jnp.float32)


def serr_rewards(entropies: jax.Array, mask: jax.Array, correct: jax.Array, truncated: jax.Array,
                 group_valid: jax.Array | None = None, *, p: float = 0.2, r_max: float = 0.5,
                 scope: str = "truncated") -> tuple[jax.Array, jax.Array]:
    """SERR rewards for a batch of groups (R3-SPEC §6): (rewards float32 [P, G], scored bool [P, G]).

    entropies, mask `[P, G, T]` (mask: the response's real tokens); correct, truncated, group_valid `[P, G]`
    (group_valid False: a padded or unused slot, as if absent; None: all valid).

    A response is in scope when its group's valid responses are all wrong (one correct response anywhere in
    the group, truncated or not, and SERR never fires there), it is valid and wrong, it has at least one token,
    and, with scope "truncated", it is truncated. The in-scope responses of each group are ranked
    (`entropy_features` → `dominance_counts` → `rank_rewards`); the rewards replace their 0 reward.

    `scored` is exactly the in-scope set: every response whose reward SERR decided, including the lone one of
    a group with n = 1 (its reward is 0). Groups that were actually ranked are those with `scored.sum(-1) >= 2`.
    """
    SERRConfig(p=p, r_max=r_max, scope=scope)
    mask, correct, truncated = (jnp.asarray(x, bool) for x in (mask, correct, truncated))
    valid = jnp.ones(correct.shape, bool) if group_valid is None else jnp.asarray(group_valid, bool)  # [P, G]
    if mask.shape != entropies.shape or {correct.shape, truncated.shape, valid.shape} != {entropies.shape[:-1]}:
        raise ValueError(f"SERR wants entropies and mask [P, G, T] and correct, truncated, group_valid [P, G]; got "
                         f"{entropies.shape}, {mask.shape}, {correct.shape}, {truncated.shape}, {valid.shape}")
    all_wrong = ~jnp.any(valid & correct, axis=-1, keepdims=True)  # [P, 1]
    rankable = valid & ~correct & jnp.any(mask, axis=-1)  # [P, G] wrong, with at least one token
    in_scope = all_wrong & (rankable & truncated if scope == "truncated" else rankable)
    e_peak, e_glob = entropy_features(entropies, mask, p)  # [P, G] each
    s = dominance_counts(e_peak, e_glob, in_scope)
    return rank_rewards(s, in_scope, r_max), in_scope
