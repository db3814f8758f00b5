"""Sample-level (record-level) PLD accountant for DP-SCAFFOLD-style training.

Setting. Each of T rounds, each client takes part with probability l (``client_rate``). A
client that takes part runs K (``local_steps``) local DP-SGD steps; each step samples each of
its records independently with probability s (``data_rate``, Poisson) and adds Gaussian noise
with multiplier σ_e (``noise_multiplier``: std σ_e times the per-record L2 sensitivity, e.g.
DP-SCAFFOLD's σ_e = σ_g·√(lM), ``TwoLevelSampleAccountant.effective_noise_multiplier``).
Adjacency: add or remove one record (dp-accounting's ``ADD_OR_REMOVE_ONE``); ε is the larger of
the two directions, both of which are kept.

Inner mechanism (one round, given that the record's client takes part). The K-fold composition
of the s-Poisson-subsampled Gaussian with multiplier σ_e. Its PLD is

    PLD_K = from_gaussian_mechanism(standard_deviation=σ_e, sampling_prob=s,
                                    value_discretization_interval=h).self_compose(K)

(pessimistic estimate, so its hockey-stick divergence δ_K(ε) is an upper bound), which is
exactly what ``dp_accounting.pld.PLDAccountant`` composes for
``SelfComposedDpEvent(PoissonSampledDpEvent(s, GaussianDpEvent(σ_e)), K)``.

Client sampling. Let A and B be the inner mechanism's outputs on the two neighbouring datasets
and N the round's output when the record's client is not sampled; N does not depend on the
record. The round outputs

    μ = (1 − l)·N + l·A    and    μ' = (1 − l)·N + l·B.

Without client-level noise the adversary may learn whether the client took part (the server
picks the clients and sees who answers), so N may have support disjoint from A's and B's. In
that worst case the privacy loss log(μ/μ') is exactly 0 on N's support and log(A/B) on theirs:
the round's PLD is the mixture

    PLD_round = (1 − l)·δ₀ + l·PLD_K        (in each direction, remove and add),

i.e. every probability of PLD_K multiplied by l, mass 1 − l added at loss 0 and the mass at
+∞ multiplied by l. Its hockey-stick divergence is exactly

    δ_round(ε) = l·δ_K(ε)        for every ε ≥ 0

(the atom at loss 0 contributes (1 − e^ε)_+ = 0). In every other case this is an upper bound:
the hockey-stick divergence H_α(P‖Q) = ∫(dP − α·dQ)_+ is jointly convex for every α ≥ 0, so
H_α(μ‖μ') ≤ (1 − l)·H_α(N‖N) + l·H_α(A‖B) = (1 − l)·(1 − α)_+ + l·H_α(A‖B), which is
H_α of the mixture pair at every α = e^ε, ε ∈ ℝ. The mixture pair is therefore a dominating
pair of the round (Zhu, Dong & Wang 2022, Def. 7), and T rounds (adaptively) composed are
dominated by the T-fold product (their Thm 10):

    PLD_T = PLD_round.self_compose(T),    ε(T, δ) = PLD_T.get_epsilon_for_delta(δ).

Only the marginal probability l that the record's client takes part enters: the bound holds for
Poisson client sampling and for a fixed-size cohort of m = lM clients drawn without replacement
alike (conditionally on the client taking part or not, the other clients' updates are
post-processing that does not depend on the record).

Why not Wang–Balle–Kasiviswanathan's Thm 9 at the client level. The DP-SCAFFOLD paper (and
``TwoLevelSampleAccountant`` in ``privacy.subsampling_wor``) amplifies the inner RDP ε_in(α)
by sampling l of the clients without replacement with WBK 2019, Thm 9. That theorem bounds
M∘subsample when the base mechanism M is RDP with respect to *replacing one element* of the
sampled set, here a whole client. Per-record DP-SGD inside a client protects one record, not a
whole client (replacing a client changes all of its records; nothing bounds that), so ε_in is
not the base RDP Thm 9 needs. The bound is also contradicted where participation is
observable: the exact Rényi divergence of the mixture pair above is

    D_α(round) = log(1 + l·(e^{(α−1)·D_α(A‖B)} − 1)) / (α − 1),

first order in l, and its δ is exactly l·δ_K(ε), whereas Thm 9's leading term is
l²·C(α, 2)·min{4(e^{ε(2)} − 1), 2e^{ε(2)}}, second order in l: for small enough l it reports
less than the exact loss of a mechanism that meets its hypotheses about the inner steps. (Its
other artefact is the floor (1/(α−1))·log(1 + 2·Σ_{j≥3} l^j·C(α, j)) as σ → ∞; the mixture's ε
goes to 0 as σ_e → ∞.) At the paper's setting (M = 100, R_train = 4000, δ = 2.5e-6,
l = s = 0.2, σ_g = 60 so σ_e = 60·√20 ≈ 268, K = 50, T = 400) the paper's accountant gives
ε ≈ 12.91 and this one ε ≈ 0.170; at l = 0.05 (σ_e = 60·√5 ≈ 134) 4.15 and 0.178. Conversely,
at l = 0.01, σ_g = 3 (σ_e = 3), K = 50, T = 400 the paper's is the smaller, 4.79 against 6.44.

Implementation. The mixture is dp-accounting's public
``PLD_K.compute_mixture(identity(h), l)`` (``PrivacyLossDistribution.compute_mixture``; both
directions, symmetric stays symmetric). The round PLD is cached per (l, s, K, σ_e, h); ε(T)
self-composes it T times (FFT). At the paper's setting (h = 1e-4) the first ε costs ≈40 ms
(building PLD_K included), each further T ≈12 ms; ``max_rounds`` ≈0.6 s (T ≈ 11000 for ε = 1).

Discretisation: h = 1e-4 by default (dp-accounting's default), pessimistic, so ε is an upper
bound. At the paper's setting it is 0.16% above the value at h = 1e-5 (0.16992 vs 0.16965);
h = 1e-3 overstates it by 15%.

Range: a PLD's cost grows with its support, i.e. with ε. ε is computed only while a cheap RDP
upper bound is at most ``max_epsilon`` (default 100): dp-accounting's RDP of the s-subsampled
Gaussian (Mironov et al. 2019) at its default orders, times K, mixed over client sampling as
above (log((1 − l) + l·e^{(α−1)·K·ε_s(α)})/(α − 1)), times T, converted to ε with
``rdp_privacy_accountant.compute_epsilon``. Beyond it ``epsilon`` raises ``ValueError`` (such
an ε carries no meaningful guarantee). (dp-accounting's RDP, not Opacus's: importing Opacus
pulls in torch, ~6 s.)
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from privacy.search import largest_meeting

# dp-accounting is imported inside the functions that use it, never at module level: its import
# pulls in scipy.signal and scipy.stats, 2.6-2.8 s (``python -X importtime``, after numpy and
# scipy.special), which every run would pay at start-up (cluster.config and cluster.claims
# import this module) though only record-level accounting uses it
# (tests/test_import_layers.py checks the start-up).
if TYPE_CHECKING:
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

ADJACENCIES = ("add_remove", "replace_one")
DEFAULT_VALUE_DISCRETIZATION_INTERVAL = 1e-4
DEFAULT_MAX_EPSILON = 100.0


@lru_cache(maxsize=1)
def _rdp_orders() -> tuple[float, ...]:
    """dp-accounting's default RDP orders (the RDP analyses' orders here and in
    ``privacy.record_level``)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    return tuple(rdp_lib.DEFAULT_RDP_ORDERS)


def mixture_pld(
    inner: pld_lib.PrivacyLossDistribution,
    client_rate: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
) -> pld_lib.PrivacyLossDistribution:
    """PLD of a round whose record-dependent part ``inner`` runs with probability l.

    (1 − l)·δ₀ + l·``inner`` in each direction (remove and add), i.e. dp-accounting's
    ``inner.compute_mixture(identity(h), l)``; symmetric stays symmetric; l = 1 returns
    ``inner`` itself. ``value_discretization_interval`` (h) must be ``inner``'s own (and
    ``inner`` pessimistic), otherwise ``compute_mixture`` raises ValueError.
    """
    if not 0.0 < client_rate <= 1.0:
        raise ValueError(f"client_rate must be in (0, 1], got {client_rate}")
    if client_rate == 1.0:
        return inner
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    identity = pld_lib.identity(value_discretization_interval=value_discretization_interval)
    return inner.compute_mixture(identity, client_rate)


@lru_cache(maxsize=32)
def _inner_pld(
    noise_multiplier: float,
    data_rate: float,
    local_steps: int,
    interval: float,
    adjacency: str = "add_remove",
) -> pld_lib.PrivacyLossDistribution:
    """PLD_K: K local steps of the s-Poisson-subsampled Gaussian.

    add/remove: dp-accounting's PLD of one s-subsampled Gaussian release at interval h (the
    client-level round's mechanism, applied to records: ``privacy.pld_numpy`` computes the
    same one without dp-accounting). replace-one: dp-accounting's
    ``REPLACE_ONE`` relation, which with sensitivity 1 compares a record's contribution −1
    against +1 (2 apart): in units of C, the replaced record moves the clipped sum by up to 2
    and the noise std is 2σ_g (noise 2Cσ_g). Either is self-composed K times.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.privacy_accountant import NeighboringRelation as NeighborRel

    if adjacency == "replace_one":
        step = pld_lib.from_gaussian_mechanism(
            standard_deviation=2.0 * noise_multiplier,
            value_discretization_interval=interval,
            sampling_prob=data_rate,
            neighboring_relation=NeighborRel.REPLACE_ONE,
        )
    else:
        step = pld_lib.from_gaussian_mechanism(
            standard_deviation=noise_multiplier,
            value_discretization_interval=interval,
            sampling_prob=data_rate,
        )
    return step.self_compose(local_steps)


@lru_cache(maxsize=32)
def _round_pld(
    client_rate: float,
    data_rate: float,
    local_steps: int,
    noise_multiplier: float,
    interval: float,
    adjacency: str = "add_remove",
) -> pld_lib.PrivacyLossDistribution:
    """PLD_round = (1 − l)·δ₀ + l·PLD_K, cached per (l, s, K, σ_e, h, adjacency)."""
    inner = _inner_pld(noise_multiplier, data_rate, local_steps, interval, adjacency)
    return mixture_pld(inner, client_rate, value_discretization_interval=interval)


@lru_cache(maxsize=32)
def _round_rdp(
    client_rate: float, data_rate: float, local_steps: int, noise_multiplier: float
) -> np.ndarray:
    """RDP upper bound of one round at ``_rdp_orders()`` (for the range guard only)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    accountant = rdp_lib.RdpAccountant(_rdp_orders())  # add/remove one record
    event = dp_event.PoissonSampledDpEvent(data_rate, dp_event.GaussianDpEvent(noise_multiplier))
    # For small σ the series at fractional orders near 1 may not converge; dp-accounting then
    # drops those orders (the bound stays valid) and logs a warning per order through absl.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        accountant.compose(event, local_steps)
    finally:
        absl_logger.setLevel(level)
    orders, inner = accountant.orders, accountant.rdp  # inner: K·ε_s(α) ≥ D_α(A‖B)
    exponent = (orders - 1.0) * inner
    log_stay = math.log1p(-client_rate) if client_rate < 1.0 else -math.inf
    return np.logaddexp(log_stay, math.log(client_rate) + exponent) / (orders - 1.0)


class SampleLevelPldAccountant:
    """Record-level ε of T rounds of client sampling (l) around K local DP-SGD steps (s, σ_e).

    See the module docstring for the mechanism, the mixture PLD and why it is used instead of
    the paper's client-level WOR amplification. ``epsilon`` and ``max_rounds`` have the same
    interface as ``TwoLevelSampleAccountant.epsilon`` / ``max_rounds``.
    """

    def __init__(
        self,
        client_rate: float,
        data_rate: float,
        local_steps: int,
        noise_multiplier: float,
        value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
        max_epsilon: float = DEFAULT_MAX_EPSILON,
        adjacency: str = "add_remove",
    ) -> None:
        """Validate and store the parameters; nothing is computed until ε is asked for.

        Args:
            client_rate: l ∈ (0, 1], the probability that a client takes part in a round.
            data_rate: s ∈ (0, 1], the Poisson rate at which a local step samples a record.
            local_steps: K ≥ 1 local DP-SGD steps per round of a participating client.
            noise_multiplier: σ_e > 0, noise std relative to the per-record L2 sensitivity.
            value_discretization_interval: h > 0, the PLD's loss grid (pessimistic rounding).
            max_epsilon: refuse (ValueError) where the cheap RDP bound on ε exceeds this.
            adjacency: ``add_remove`` (σ relative to C) or ``replace_one`` (σ relative to the
                replace sensitivity 2C; the range guard then uses add/remove at σ/2).

        Raises:
            ValueError: naming the first argument out of range.
        """
        client_rate = _number("client_rate", client_rate)
        data_rate = _number("data_rate", data_rate)
        noise_multiplier = _number("noise_multiplier", noise_multiplier)
        h = _number("value_discretization_interval", value_discretization_interval)
        max_epsilon = _number("max_epsilon", max_epsilon)
        if not 0.0 < client_rate <= 1.0:
            raise ValueError(f"client_rate must be in (0, 1], got {client_rate!r}")
        if not 0.0 < data_rate <= 1.0:
            raise ValueError(f"data_rate must be in (0, 1], got {data_rate!r}")
        if isinstance(local_steps, bool) or not isinstance(local_steps, int | np.integer):
            raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        if local_steps < 1:
            raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        if not 0.0 < noise_multiplier < math.inf:
            raise ValueError(f"noise_multiplier must be finite and > 0, got {noise_multiplier!r}")
        if not 0.0 < h < math.inf:
            raise ValueError(f"value_discretization_interval must be finite and > 0, got {h!r}")
        if not max_epsilon > 0.0:
            raise ValueError(f"max_epsilon must be > 0, got {max_epsilon!r}")
        if adjacency not in ADJACENCIES:
            raise ValueError(f"adjacency must be one of {ADJACENCIES}, got {adjacency!r}")
        self.adjacency = adjacency
        self.client_rate = float(client_rate)
        self.data_rate = float(data_rate)
        self.local_steps = int(local_steps)
        self.noise_multiplier = float(noise_multiplier)
        self.value_discretization_interval = float(h)
        self.max_epsilon = float(max_epsilon)
        self._eps_memo: dict[tuple[int, float], float] = {}

    @property
    def round_pld(self) -> pld_lib.PrivacyLossDistribution:
        """PLD of one round, (1 − l)·δ₀ + l·PLD_K (cached per parameters, module-wide)."""
        return _round_pld(
            self.client_rate,
            self.data_rate,
            self.local_steps,
            self.noise_multiplier,
            self.value_discretization_interval,
            self.adjacency,
        )

    def rdp_epsilon(self, rounds: int, delta: float) -> float:
        """Cheap RDP upper bound on ε after ``rounds`` rounds (the range guard)."""
        rounds, delta = _validated(rounds, delta)
        if rounds == 0:
            return 0.0
        # replace-one (sensitivity 2C, noise 2Cσ) is guarded with add/remove at σ/2
        sigma = self.noise_multiplier / (2.0 if self.adjacency == "replace_one" else 1.0)
        curve = _round_rdp(self.client_rate, self.data_rate, self.local_steps, sigma)
        from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

        eps, _ = rdp_lib.compute_epsilon(_rdp_orders(), rounds * curve, delta)
        return float(eps)

    def epsilon(self, rounds: int, delta: float) -> float:
        """ε after ``rounds`` rounds at the given δ (0.0 for no round).

        Raises:
            ValueError: for rounds < 0 or δ ∉ (0, 1), or where the RDP bound on ε exceeds
                ``max_epsilon`` (the PLD would be very wide and ε meaningless).
        """
        rounds, delta = _validated(rounds, delta)
        if rounds == 0:
            return 0.0
        key = (rounds, delta)
        if key not in self._eps_memo:
            bound = self.rdp_epsilon(rounds, delta)
            if bound > self.max_epsilon:
                raise ValueError(
                    f"sample-level PLD accounting refused: the RDP bound ε={bound:.4g} after "
                    f"{rounds} rounds at δ={delta:g} exceeds max_epsilon={self.max_epsilon:g}; "
                    "a PLD that wide takes seconds to minutes and gigabytes, and such an ε "
                    "gives no meaningful guarantee (raise max_epsilon to force it)."
                )
            eps = float(self.round_pld.self_compose(rounds).get_epsilon_for_delta(delta))
            if len(self._eps_memo) >= 256:
                self._eps_memo.clear()
            self._eps_memo[key] = eps
        return self._eps_memo[key]

    def max_rounds(self, target_epsilon: float, delta: float, limit: int = 100_000) -> int:
        """Largest T ≤ ``limit`` with ε(T) ≤ ``target_epsilon``; 0 if even ε(1) exceeds it.

        Doubling then bisection (``privacy.search.largest_meeting``; ε grows with T). The
        search never goes past the largest T at which the RDP range guard still allows a PLD
        (found the same way; the RDP bound grows with T); if ε there is still within the
        target (only possible for target_epsilon near ``max_epsilon``), ValueError is raised
        rather than returning a T that is not the largest.
        """
        if isinstance(limit, bool) or int(limit) != limit or limit < 0:
            raise ValueError(f"limit must be a non-negative integer, got {limit!r}")
        if not target_epsilon >= 0.0:
            raise ValueError(f"target_epsilon must be >= 0, got {target_epsilon!r}")
        _validated(0, delta)
        limit = int(limit)
        cap = largest_meeting(lambda t: self.rdp_epsilon(t, delta) <= self.max_epsilon, limit)
        best = largest_meeting(lambda t: self.epsilon(t, delta) <= target_epsilon, cap)
        if best == cap < limit:
            raise ValueError(
                f"max_rounds: ε({cap}) ≤ target_epsilon={target_epsilon:g} but ε beyond "
                f"{cap} rounds is refused (RDP bound > max_epsilon={self.max_epsilon:g}); "
                "raise max_epsilon or lower target_epsilon."
            )
        return best


def _number(name: str, value: object) -> float:
    """``value`` as a float, or ValueError naming the argument."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _validated(rounds: int, delta: float) -> tuple[int, float]:
    if isinstance(rounds, bool) or int(rounds) != rounds or rounds < 0:
        raise ValueError(f"rounds must be a non-negative integer, got {rounds!r}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return int(rounds), float(delta)
