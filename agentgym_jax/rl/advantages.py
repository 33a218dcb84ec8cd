"""Advantage estimators over multi-turn agent trajectories, chosen by name from `ESTIMATORS`.

Layout of a row (one episode, right-padded to L tokens):

  prompt | agent turn 1 | observation 1 | agent turn 2 | ... | agent turn K | padding
  mask:  0 ... 0 | 1 ....... 1 | 0 ......... 0 | 1 ....... 1 | ... | 1 ....... 1 | 0 ... 0

`mask` is 1 on the tokens the policy sampled (its end-of-turn token included) and 0 on prompt,
observation and padding tokens. `rewards` holds the outcome reward on the last agent token (the
last position where mask is 1), optionally per-turn rewards and a per-token KL penalty
(`losses.kl_in_reward`) on agent tokens.

Every estimator has the same signature, so the trainer calls `ESTIMATORS[name](...)` blindly:

  advantages, returns = fn(rewards, mask, *, values=None, group_ids=None,
                           gamma=1.0, lam=1.0, eps=1e-6, turns=None)

  rewards    [B, L] float       token rewards.
  mask       [B, L] bool|float  1 on agent tokens.
  values     [B, L] float       critic values V_t (used by `gae`, ignored by the others).
  group_ids  [B] int            rows with equal ids are samples of one task (used by the group
                                estimators grpo, drgrpo, rloo, reinforce_plus_plus_baseline).
  gamma, lam                    discount and GAE lambda (`gae`; `gamma` also for
                                `reinforce_plus_plus`).
  eps                           added to the group std (`grpo`, `gigpo`).
  turns      `Turns`            the batch's turn structure: turn of each token, each
                                environment step's reward, the state each turn acted from
                                (used by the turn-level estimators `gigpo` and `turn_gae`).
  -> advantages [B, L], returns [B, L] (critic targets for `gae`), both 0 where mask is 0, in
     float32 (float64 when the inputs are float64).

An estimator may take keyword options of its own after these (`gigpo`'s step_weight and
step_norm, `turn_gae`'s turn_gamma): `options(name)` lists them, and a config sets them in
`algo.estimator_kwargs` (`rl.algorithm` checks the names against the signature and passes them
in; a string option must be a static argument of the estimator's jit). What an estimator needs
beyond the rewards is declared where it is registered, as `ESTIMATORS` traits that
`rl.algorithm` reads:

  @ESTIMATORS.register("turn_gae", uses_critic=True, uses_turns=True)

  uses_critic  a value model is trained and its `values` passed in (`gae`, `turn_gae`).
  uses_turns   the batch's `turns` are passed in (`gigpo`, `turn_gae`).
  choices      {option: allowed values} for options with a fixed set of values, checked when
               the config is read (`gigpo`'s step_norm).

Scalars may be Python floats or traced arrays: new values never recompile. Shapes are checked at
trace time. The estimators are jitted; called inside another jit they are inlined.

Semantics follow verl (`verl/trainer/ppo/core_algos.py`) with two deliberate differences, both
about multi-turn layouts: (1) `reinforce_plus_plus` carries the return through observation tokens
(verl multiplies the running return by the mask, so an observation segment cuts every earlier
turn off from the outcome reward); (2) outputs are 0 on mask-0 positions (verl leaves whitened
values there, which the loss mask then ignores).

Outcome estimators score a row by s_b = Σ_t rewards[b, t], so where the reward sits in the row
does not matter to them. Token-level estimators (`gae`, `reinforce_plus_plus`) read rewards on
agent tokens only, as verl's do: a reward on a mask-0 position is ignored by them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from agentgym_jax.rl.registry import Registry

# verl's `masked_whiten` constant: keeps rsqrt finite when all advantages are equal.
WHITEN_EPS = 1e-8


# name -> estimator with the signature in the module docstring, and its traits (the module
# docstring).
ESTIMATORS: Registry = Registry("advantage estimator", uses_critic=False, uses_turns=False,
                                choices={})
# The arguments every estimator takes; the keyword arguments beyond these are its options.
COMMON_ARGS = ("rewards", "mask", "values", "group_ids", "gamma", "lam", "eps", "turns")
# gigpo's step-level normalisations (verl-agent's `mode`): subtract the group mean, or also
# divide by the group std.
STEP_NORMS = ("mean_norm", "mean_std_norm")


def options(name: str) -> dict[str, Any]:
  """The keyword options of estimator `name` beyond `COMMON_ARGS`, with their defaults.

  Raises:
    KeyError: `name` is not registered (the message lists the registered names).
  """
  parameters = inspect.signature(ESTIMATORS[name]).parameters.values()
  return {p.name: p.default for p in parameters
          if p.name not in COMMON_ARGS and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


@struct.dataclass
class Turns:
  """The turn structure of a batch (`Trajectory`'s turn fields), for turn-level credit.

  index    [B, L] int    agent turn of each token, -1 on the opening prompt (an observation
                         shares the index of the turn it answers; only agent tokens are read).
  rewards  [B, L] float  what each environment step added to the episode's reward, on the
                         last agent token of the turn that took it (they sum to the outcome).
  anchors  [B, T] int    id of the state turn k acted from (equal ids: the same state), -1
                         past the episode's last turn; T bounds every row's turn count.
  """

  index: jax.Array
  rewards: jax.Array
  anchors: jax.Array


def _prepare(name: str, rewards, mask, values, group_ids, *, need_values: bool = False,
             need_groups: bool = False):
  """Checks shapes (at trace time) and casts; returns (rewards, mask, values, group_ids)."""
  rewards = jnp.asarray(rewards)
  mask = jnp.asarray(mask)
  if rewards.ndim != 2:
    raise ValueError(f"{name}: rewards must be [B, L], got shape {rewards.shape}")
  if mask.shape != rewards.shape:
    raise ValueError(f"{name}: mask shape {mask.shape} != rewards shape {rewards.shape}; both "
                     "must be [B, L] over the same tokens")
  dtype = jnp.result_type(rewards.dtype, jnp.float32)
  if need_values:
    if values is None:
      raise ValueError(f"{name} needs values=[B, L] from the critic; got values=None")
    values = jnp.asarray(values)
    if values.shape != rewards.shape:
      raise ValueError(f"{name}: values shape {values.shape} != rewards shape {rewards.shape}")
    dtype = jnp.result_type(dtype, values.dtype)
    values = values.astype(dtype)
  if need_groups:
    if group_ids is None:
      raise ValueError(f"{name} needs group_ids=[B] (one id per task, shared by its samples); "
                       "got group_ids=None")
    group_ids = jnp.asarray(group_ids)
    if group_ids.shape != rewards.shape[:1]:
      raise ValueError(f"{name}: group_ids must be [B] = {rewards.shape[:1]}, got shape "
                       f"{group_ids.shape}")
  return rewards.astype(dtype), mask.astype(dtype), values, group_ids


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean of x [B, L] over positions where mask [B, L] is 1 -> scalar (0 if mask is all 0)."""
  return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def _first_member_value(x: jax.Array, same: jax.Array) -> jax.Array:
  """x [N] at the first member of each row's set: `same` [M, N] bool -> [M] (x[0] where a row
  has no member; its statistics are then unused)."""
  return x[jnp.argmax(same, axis=1)]


def masked_whiten(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Whitens x [B, L] over the masked tokens of the whole batch -> [B, L], 0 where mask is 0.

  (x - μ) / sqrt(σ² + 1e-8), μ and σ² the masked mean and unbiased (n / (n - 1)) variance, as
  verl's `masked_whiten`. With n <= 1 masked tokens the result is 0 instead of verl's error.
  The statistics are taken of x - x₀, x₀ the first masked token's value (the same μ, σ²
  mathematically): equal values then give exactly 0, not their mean's rounding error
  amplified by rsqrt(1e-8) (`_stats_over`).
  """
  n = jnp.sum(mask)
  inside = (mask > 0).reshape(-1)
  x = x - _first_member_value(x.reshape(-1), inside[None, :])[0]
  mean = masked_mean(x, mask)
  centered = jnp.where(mask > 0, x - mean, 0.0)
  var = jnp.sum(jnp.square(centered)) / jnp.maximum(n - 1.0, 1.0)
  return centered * lax.rsqrt(var + WHITEN_EPS)


def _group_stats(scores: jax.Array, group_ids: jax.Array, members: jax.Array | None = None):
  """Per-row statistics of the row's group: (score - group mean [B], unbiased std [B],
  size [B]).

  A [B, B] same-group indicator replaces verl's Python dict of lists: ids can be any integers,
  no static group count is needed, and the products are elementwise (exact in float32 on every
  backend, unlike a matmul at default TPU precision); B² elements are cheap for B in the
  thousands. Singleton groups get mean 0 and std 1, as verl: a lone sample has no baseline,
  so its advantage is its own score.

  `members` [B] bool (default all) says which rows the statistics are computed over; `size`
  counts them. A group of several rows left with fewer than two members has no baseline
  either, but unlike a singleton by design it gets mean = the row's own score and std 1, so
  that every group estimator gives its rows advantage 0.
  """
  return _stats_over(scores, group_ids[:, None] == group_ids[None, :], members)


def _stats_over(scores: jax.Array, same: jax.Array, members: jax.Array | None = None, *,
                lone_is_own_mean: bool = False):
  """`_group_stats` for any grouping: `same` [N, N] bool says which entries share a group
  (reflexive and symmetric). -> (score - group mean [N], unbiased std [N], size [N]).

  Exactly 0 for equal members: the deviations and the std are computed from the scores minus
  the group's first member, c_j = s_j - s_first, as (c_b - mean(c)) and std(c) (the same
  values mathematically). Equal members have c = 0 exactly, so their deviation and std are 0
  and every estimator's advantage is 0, where s_b - mean(s) would be the rounding error of the
  mean (float32: 8 x 0.9 -> -6e-8, which GRPO's division by std + 1e-6 made -0.056).

  `lone_is_own_mean`: a true singleton (no other row in `same`) is its own mean (deviation 0)
  instead of having mean 0 (deviation = its score): GiGPO's step groups (Eq. 7).
  """
  dtype = scores.dtype
  rows = jnp.sum(same.astype(dtype), axis=1)
  if members is not None:
    same = same & members[None, :].astype(bool)
  weights = same.astype(dtype)
  size = jnp.sum(weights, axis=1)
  first = _first_member_value(scores, same)
  centred = scores[None, :] - first[:, None]  # [N, N]: member j's score minus row i's first
  mean = jnp.sum(weights * centred, axis=1) / jnp.maximum(size, 1.0)
  deviation = (scores - first) - mean
  var = jnp.sum(weights * jnp.square(centred - mean[:, None]), axis=1) / jnp.maximum(
      size - 1.0, 1.0)
  single = size < 2
  lone_deviation = 0.0 if lone_is_own_mean else jnp.where(rows < 2, scores, 0.0)
  deviation = jnp.where(single, lone_deviation, deviation)
  return deviation, jnp.where(single, 1.0, jnp.sqrt(var)), size


def _group_outcomes(name: str, rewards, mask, group_ids):
  """The group estimators' common start: checks and casts (`_prepare`), then each row's outcome
  s_b = Σ_t r_bt and its group's statistics. -> (mask, scores [B], s_b - mean_g [B] (exactly 0
  in a group of equal outcomes), std [B], size [B]).

  Rows without agent tokens are no sample of the policy (a failed episode, whose loss mask the
  trajectory zeroes, or one that ended before its first turn): they stay out of the statistics.
  """
  rewards, mask, _, group_ids = _prepare(name, rewards, mask, None, group_ids, need_groups=True)
  scores = jnp.sum(rewards, axis=1)
  return (mask, scores, *_group_stats(scores, group_ids, jnp.any(mask > 0, axis=1)))


def _broadcast(row_values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[B] -> [B, L] on agent tokens; returned as both advantages and returns (verl's convention)."""
  adv = row_values[:, None] * mask
  return adv, adv


def _recurrence_scan(a: jax.Array, b: jax.Array) -> jax.Array:
  """x_t = a_t x_{t+1} + b_t along axis 1 of [B, L], x_L = 0, by a reverse `lax.scan`."""

  def step(x, ab):
    x = ab[0] * x + ab[1]
    return x, x

  _, xs = lax.scan(step, jnp.zeros(a.shape[:1], a.dtype), (a.T, b.T), reverse=True)
  return xs.T


def _recurrence_associative(a: jax.Array, b: jax.Array) -> jax.Array:
  """The same recurrence by `lax.associative_scan`: O(log L) depth instead of L steps.

  Element t is the affine map x -> a_t x + b_t; scanning from the end composes the maps of t..L-1
  and applies them to x_L = 0, which leaves the offset.
  """

  def compose(later, earlier):  # earlier ∘ later: apply the later position's map first
    return later[0] * earlier[0], earlier[0] * later[1] + earlier[1]

  return lax.associative_scan(compose, (a, b), reverse=True, axis=1)[1]


def _reverse_recurrence(a: jax.Array, b: jax.Array) -> jax.Array:
  """x_t = a_t x_{t+1} + b_t, x_L = 0, over [B, L]: the sequential scan on CPU (measured faster,
  benchmarks/README.md), the log-depth associative scan elsewhere (a 4096-step scan on GPU/TPU is
  4096 dependent loop iterations)."""
  return lax.platform_dependent(a, b, cpu=_recurrence_scan, default=_recurrence_associative)


def _gae_scan(rewards, values, mask, gamma, lam):
  """Raw (unwhitened) GAE [B, L]: one reverse scan carrying both V' and A' (fastest on CPU)."""

  def step(carry, xs):
    next_value, next_adv = carry
    r, v, m = xs
    adv = r + gamma * next_value - v + gamma * lam * next_adv
    next_value = m * v + (1.0 - m) * next_value
    next_adv = m * adv + (1.0 - m) * next_adv
    return (next_value, next_adv), next_adv

  zeros = jnp.zeros(rewards.shape[:1], rewards.dtype)
  _, adv = lax.scan(step, (zeros, zeros), (rewards.T, values.T, mask.T), reverse=True)
  return adv.T


def _gae_associative(rewards, values, mask, gamma, lam):
  """Raw GAE [B, L] as two affine recurrences, each by associative scan.

    N_t = (1 - m_t) N_{t+1} + m_t V_t         value of the first agent token at or after t
    A_t = (1 - m_t + m_t γλ) A_{t+1} + m_t δ_t,   δ_t = r_t + γ N_{t+1} - V_t
  """
  next_value = _recurrence_associative(1.0 - mask, mask * values)
  next_value = jnp.concatenate([next_value[:, 1:], jnp.zeros_like(next_value[:, :1])], axis=1)
  delta = rewards + gamma * next_value - values
  return _recurrence_associative(mask * (gamma * lam) + (1.0 - mask), mask * delta)


@ESTIMATORS.register("gae", uses_critic=True)
@jax.jit
def gae(rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0, eps=1e-6,
        turns=None):
  """Generalized advantage estimation over agent tokens (Schulman et al. 2016, arXiv 1506.02438).

  Reverse recursion over t with carries V' (value of the next agent token) and A' (advantage of
  the next agent token), both 0 after the last one (the episode end is terminal):

    agent token (m_t = 1):  δ_t = r_t + γ V' - V_t,  A_t = δ_t + γ λ A',  V' <- V_t, A' <- A_t
    other token (m_t = 0):   V', A' carried through unchanged

  so an observation segment is skipped, not a reset: the last token of turn k bootstraps from the
  first token of turn k+1 (verl's multi-turn GAE). returns = A + V (before whitening), then
  advantages = masked_whiten(A). `group_ids` and `eps` are unused.

  `lax.platform_dependent` picks the recursion's implementation when lowering: one reverse
  `lax.scan` on CPU, two log-depth associative scans on accelerators (same values).

  Args: see the module docstring; `values` [B, L] is required, aligned with the tokens like
    log-probabilities: values[b, t] is V of the state in which token t is sampled (for a causal
    critic, its output at position t - 1), over the same L positions as rewards and mask.
  Returns: (advantages [B, L], returns [B, L]), 0 where mask is 0.
  """
  rewards, mask, values, _ = _prepare("gae", rewards, mask, values, None, need_values=True)
  # Rewards and critic outputs off agent tokens are never used; zero them so that even a
  # non-finite one cannot leak into the carries (0 · inf would).
  rewards = jnp.where(mask > 0, rewards, 0.0)
  values = jnp.where(mask > 0, values, 0.0)
  gamma = jnp.asarray(gamma, rewards.dtype)
  lam = jnp.asarray(lam, rewards.dtype)
  adv = lax.platform_dependent(rewards, values, mask, gamma, lam, cpu=_gae_scan,
                               default=_gae_associative)
  return masked_whiten(adv, mask), (adv + values) * mask


@ESTIMATORS.register("grpo")
@jax.jit
def grpo(rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0, eps=1e-6,
         turns=None):
  """Group-relative outcome advantage (GRPO, Shao et al. 2024, arXiv 2402.03300).

    s_b = Σ_t r_bt,   A_b = (s_b - mean_g) / (std_g + eps)   over the group g of row b,

  std unbiased (ddof = 1), broadcast over the row's agent tokens: advantages = returns =
  A_b·mask. Singleton groups use mean 0, std 1 (verl). Needs `group_ids` [B]; `values`,
  `gamma`, `lam` are unused.
  """
  mask, _, deviation, std, _ = _group_outcomes("grpo", rewards, mask, group_ids)
  return _broadcast(deviation / (std + eps), mask)


@ESTIMATORS.register("drgrpo")
@jax.jit
def drgrpo(rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0, eps=1e-6,
           turns=None):
  """GRPO without the std division (Dr.GRPO, Liu et al. 2025, arXiv 2503.20783).

    s_b = Σ_t r_bt,   A_b = s_b - mean_g

  (verl: `grpo` with norm_adv_by_std_in_grpo=False), as advantages and returns on the agent
  tokens. Pair it with the `seq-mean-token-sum-norm` loss aggregation for the paper's unbiased
  objective. Singleton groups: A_b = s_b. Needs `group_ids` [B].
  """
  mask, _, deviation, _, _ = _group_outcomes("drgrpo", rewards, mask, group_ids)
  return _broadcast(deviation, mask)


@ESTIMATORS.register("rloo")
@jax.jit
def rloo(rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0, eps=1e-6,
         turns=None):
  """REINFORCE leave-one-out (RLOO, Ahmadian et al. 2024, arXiv 2402.14740).

    s_b = Σ_t r_bt,   A_b = s_b - (Σ_{j in g, j != b} s_j) / (n_g - 1)
                          = n_g / (n_g - 1) · (s_b - mean_g)

  on the agent tokens (advantages = returns). Singleton groups have no other sample: A_b = s_b
  (verl). Needs `group_ids` [B].
  """
  mask, _, deviation, _, size = _group_outcomes("rloo", rewards, mask, group_ids)
  scale = jnp.where(size > 1, size / jnp.maximum(size - 1.0, 1.0), 1.0)
  return _broadcast(scale * deviation, mask)


@ESTIMATORS.register("reinforce_plus_plus")
@jax.jit
def reinforce_plus_plus(rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0,
                        eps=1e-6, turns=None):
  """REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted return-to-go, whitened over the batch.

    agent token:  G_t = r_t + γ G'  and G' <- G_t;   other token: G' carried;   G' = 0 at the end
    advantages = masked_whiten(G),  returns = G.

  The discount counts agent tokens only, and the return crosses observation segments, so every
  turn sees the outcome reward (verl resets G at each mask-0 token, which in a multi-turn row
  zeroes every turn but the last). `values`, `group_ids`, `lam`, `eps` are unused.

  Args: see the module docstring.
  Returns: (advantages [B, L], returns [B, L]), 0 where mask is 0.
  """
  rewards, mask, _, _ = _prepare("reinforce_plus_plus", rewards, mask, None, None)
  agent_rewards = jnp.where(mask > 0, rewards, 0.0)
  returns = _reverse_recurrence(mask * gamma + (1.0 - mask), agent_rewards) * mask
  return masked_whiten(returns, mask), returns


@ESTIMATORS.register("reinforce_plus_plus_baseline")
@jax.jit
def reinforce_plus_plus_baseline(rewards, mask, *, values=None, group_ids=None, gamma=1.0,
                                 lam=1.0, eps=1e-6, turns=None):
  """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv 2501.03262; verl's `_baseline`).

    s_b = Σ_t r_bt,   a_bt = (s_b - mean_g)·m_bt,   advantages = masked_whiten(a)

  whitened over all agent tokens of the batch; returns equal the advantages. Singleton groups
  use mean 0. Needs `group_ids` [B].
  """
  mask, _, deviation, _, _ = _group_outcomes("reinforce_plus_plus_baseline", rewards, mask,
                                              group_ids)
  adv = masked_whiten(deviation[:, None] * mask, mask)
  return adv, adv


# ---------------------------------------------------------------------------------------------
# Turn-level credit: the turns of a row get different signals.
# ---------------------------------------------------------------------------------------------


def _check_turns(name: str, turns: Turns | None, shape: tuple[int, int]) -> Turns:
  if turns is None:
    raise ValueError(f"{name} needs turns=Turns(index, rewards, anchors) from the trajectory's "
                     "turn fields; got turns=None")
  if turns.index.shape != shape or turns.rewards.shape != shape:
    raise ValueError(f"{name}: turns.index {turns.index.shape} and turns.rewards "
                     f"{turns.rewards.shape} must be [B, L] = {shape}")
  if turns.anchors.ndim != 2 or turns.anchors.shape[0] != shape[0]:
    raise ValueError(f"{name}: turns.anchors must be [B, T] with B = {shape[0]}, got shape "
                     f"{turns.anchors.shape}")
  return turns


def _turn_slots(turns: Turns, mask: jax.Array) -> jax.Array:
  """[B, L] -> flat index b·T + k of each agent token's turn, or B·T (dropped) elsewhere."""
  b, t = turns.anchors.shape
  rows = jnp.arange(b, dtype=jnp.int32)[:, None] * t
  inside = (mask > 0) & (turns.index >= 0) & (turns.index < t)
  return jnp.where(inside, rows + turns.index, b * t)


def _sum_per_turn(x: jax.Array, turns: Turns, mask: jax.Array) -> jax.Array:
  """Sums x [B, L] over each turn's agent tokens -> [B, T]."""
  b, t = turns.anchors.shape
  flat = jax.ops.segment_sum(x.reshape(-1), _turn_slots(turns, mask).reshape(-1),
                             num_segments=b * t + 1)
  return flat[:-1].reshape(b, t)


def _per_token(per_turn: jax.Array, turns: Turns, mask: jax.Array) -> jax.Array:
  """[B, T] -> [B, L]: each agent token gets its turn's value, other tokens 0."""
  k = jnp.clip(turns.index, 0, per_turn.shape[1] - 1)
  return jnp.take_along_axis(per_turn, k, axis=1) * mask


@ESTIMATORS.register("gigpo", uses_turns=True, choices={"step_norm": STEP_NORMS})
@functools.partial(jax.jit, static_argnames=("step_norm",))
def gigpo(rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0, eps=1e-6,
          turns=None, step_weight=1.0, step_norm="mean_norm"):
  """Group-in-group policy optimisation (GiGPO, Feng et al. 2025, arXiv 2505.10978).

  Episode level, as GRPO over the task's group g (the paper's Eq. 3):
    s_b = Σ_t r_bt,   A^E_b = (s_b - mean_g) / (std_g + eps)
  Step level: each turn k's discounted return from the environment's step rewards (Eq. 5),
    R_bk = Σ_{j >= k} γ^(j-k) ρ_bj,   ρ_bj = Σ_{t in turn j} turns.rewards[b, t],
  normalised within its step group S: the turns of g's episodes that acted from the same
  anchor state (equal `turns.anchors`, Eq. 6), A^S_bk = (R_bk - mean_S) / (std_S + eps) (Eq. 7).
  Joined on every agent token t of turn k (Eq. 8): A_bt = A^E_b + ω A^S_bk.

  `step_norm` "mean_norm" drops the std division at both levels (A = x - mean), "mean_std_norm"
  keeps it; ω is `step_weight`, γ is `gamma` (verl-agent's runs: ω 1, γ 0.95, "mean_norm").
  Groups of one: an episode alone in its task group has mean 0 and std 1 (verl-agent's
  `episode_norm_reward`, verl's GRPO): A^E = its score; a step group of one (a state no other
  episode of the task group reached) is its own mean, std 1 (Eq. 7; verl-agent's
  `step_norm_reward`): A^S = 0. Equal members give exactly 0 at both levels (`_stats_over`).
  advantages = returns (verl's convention). Needs `group_ids` [B] and `turns`; `values`,
  `lam` are unused.

  Documented choices at the episode level that differ from verl-agent's trainer, whose rows
  are turns, not episodes:
  - Episode statistics weigh every episode once. verl-agent's `episode_norm_reward` takes
    mean and std over its turn rows, so an episode counts once per turn (long episodes weigh
    more in their group's baseline).
  - The invalid-action reward (`env.invalid_action_reward`) is part of the turn's step
    reward ρ_bk: it enters the outcome s_b and, discounted by γ, the step returns R_bj of the
    episode's earlier turns j < k. verl-agent's `apply_invalid_action_penalty` subtracts its
    penalty from the offending turn's row only (its row score and its step return).
  """
  mask, _, deviation, std, _ = _group_outcomes("gigpo", rewards, mask, group_ids)
  turns = _check_turns("gigpo", turns, rewards.shape)
  if step_norm not in STEP_NORMS:
    raise ValueError(f"gigpo: step_norm must be one of {STEP_NORMS}, got {step_norm!r}")
  divide = step_norm == "mean_std_norm"
  episode = deviation / (std + eps) if divide else deviation

  step_rewards = _sum_per_turn(jnp.asarray(turns.rewards, mask.dtype), turns, mask)
  gamma = jnp.asarray(gamma, mask.dtype)
  step_returns = _reverse_recurrence(jnp.full_like(step_rewards, gamma), step_rewards)
  # A row without agent tokens (a failed episode) is no sample: its turns join no step group.
  alive = ((turns.anchors >= 0) & jnp.any(mask > 0, axis=1)[:, None]).reshape(-1)
  groups = jnp.broadcast_to(jnp.asarray(group_ids)[:, None], turns.anchors.shape).reshape(-1)
  anchors = turns.anchors.reshape(-1)
  same = ((groups[:, None] == groups[None, :]) & (anchors[:, None] == anchors[None, :])
          & alive[:, None] & alive[None, :]) | jnp.eye(alive.size, dtype=bool)
  returns_flat = step_returns.reshape(-1)
  step, step_std, _ = _stats_over(returns_flat, same, lone_is_own_mean=True)
  if divide:
    step = step / (step_std + eps)
  step = jnp.where(alive, step, 0.0).reshape(step_returns.shape)
  adv = episode[:, None] * mask + step_weight * _per_token(step, turns, mask)
  return adv, adv


@ESTIMATORS.register("turn_gae", uses_critic=True, uses_turns=True)
@jax.jit
def turn_gae(rewards, mask, *, values=None, group_ids=None, gamma=1.0, lam=1.0, eps=1e-6,
             turns=None, turn_gamma=1.0):
  """Bi-level GAE: GAE over turns, then GAE over tokens inside each turn (RAGEN's bi-level
  GAE, Wang et al. 2025, arXiv 2504.20073; GAE: Schulman et al. 2016).

  Turn level, with V_k the critic's value at turn k's last agent token and ρ_k the turn's
  environment reward (Σ of `turns.rewards` over its tokens):
    δ_k = ρ_k + γ_turn V_{k+1} - V_k,   A_k = δ_k + γ_turn λ A_{k+1}   (0 after the last turn)
  Token level, inside turn k, from its last agent token e_k backwards:
    A_{e_k} = A_k,   A_t = γ V_{t+1} - V_t + γ λ A_{t+1}   for the turn's earlier tokens t
  so every token of a turn is credited with what its turn changed, and the critic's reading
  of the turn's state, not the episode's distant outcome, is its baseline. returns = A + V
  (critic targets), advantages = masked_whiten(A). γ is `gamma`, λ `lam`, γ_turn
  `turn_gamma`. The rewards come from `turns` alone: `rewards` (outcome and any per-token
  shaping) is unused, so a KL penalty belongs in the loss. Needs `values` and `turns`.

  Args: see the module docstring; `values` [B, L] aligned as for `gae`.
  Returns: (advantages [B, L], returns [B, L]), 0 where mask is 0.
  """
  rewards, mask, values, _ = _prepare("turn_gae", rewards, mask, values, None, need_values=True)
  turns = _check_turns("turn_gae", turns, rewards.shape)
  values = jnp.where(mask > 0, values, 0.0)
  gamma = jnp.asarray(gamma, mask.dtype)
  lam = jnp.asarray(lam, mask.dtype)
  turn_gamma = jnp.asarray(turn_gamma, mask.dtype)

  # A turn's last agent token: the next token is not an agent token of the same turn.
  index = turns.index
  following = jnp.concatenate([index[:, 1:], jnp.full_like(index[:, :1], -1)], axis=1)
  next_agent = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1) > 0
  is_end = (mask > 0) & ~(next_agent & (following == index))
  turn_values = _sum_per_turn(jnp.where(is_end, values, 0.0), turns, mask)  # [B, T]
  turn_rewards = _sum_per_turn(jnp.asarray(turns.rewards, mask.dtype), turns, mask)
  next_values = jnp.concatenate([turn_values[:, 1:], jnp.zeros_like(turn_values[:, :1])], 1)
  delta = turn_rewards + turn_gamma * next_values - turn_values
  turn_adv = _reverse_recurrence(jnp.full_like(delta, turn_gamma * lam), delta)

  # Inside a turn: x_t = γλ x_{t+1} + (γ V_{t+1} - V_t), restarted at A_k on its last token.
  next_token_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
  a = jnp.where(is_end | (mask <= 0), 0.0, gamma * lam)
  b = jnp.where(is_end, _per_token(turn_adv, turns, mask),
                jnp.where(mask > 0, gamma * next_token_values - values, 0.0))
  adv = _reverse_recurrence(a, b) * mask
  return masked_whiten(adv, mask), (adv + values) * mask
