"""Client-level privacy accounting with privacy loss distributions (PLD).

Each round is one release of the sum of the sampled clients' clipped updates with Gaussian noise
of std σC, amplified by sampling clients with rate q: dp-accounting's
``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``. ``PldAccountant`` composes the rounds
numerically with privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022,
``dp_accounting.pld``), tight up to the discretisation, and reads ε off the composed PLD for
the requested δ. σ and q may change from round to round.

What is composed is what ``dp_accounting.pld.PLDAccountant`` composes for
``compose(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), count)`` applied once per run of equal
rounds, in order: the identity PLD, then for each (σ, q, count) of the merged history
``from_gaussian_mechanism(σ, sampling_prob=q).self_compose(count)``, at the interval that
``privacy.pld_runs.discretization_for`` picks for the history: 1e-4 (dp-accounting's default)
while the composed PLD fits 2¹⁷ points, else 1e-4·2ᵏ for the smallest k at which it does. At
that interval the value is bit-identical to ``PLDAccountant``'s (tests). The accountant computes
with ``privacy.pld_numpy``, a NumPy port of those ``privacy_loss_distribution`` steps (without
dp-accounting, whose import pulls in ``scipy.stats``), so that it can cache: the one-round PLD
and its Chernoff moments once per distinct (σ, q, interval) (``privacy.pld_runs``), and the PLD
of the runs before the last one. ε after one more round then costs one self-composition of at
most 2¹⁷ points, one composition and one ε look-up: 0.03-0.05 s at q = 0.2, σ = 1 for every T
from 1 to 10,000 once the caches are warm (1e-4 throughout: 0.3 s at T = 1, 1.4 s at
T = 1,000), plus a one-off 0.1-0.8 s per interval the run reaches (dp-accounting's
construction, which ``privacy.pld_numpy`` does with 23–31× less CPU: benchmarks/NOTES.md). Only the
first ε after ``load_state_dict`` composes the whole history (100 distinct runs of 10 rounds:
59–65 s, the next round's ε 0.23 s). The composed PLD is memoised,
so ``epsilon_after`` followed by ``step`` with the same (σ, q) and ``epsilon`` composes once. ε
is a deterministic function of the merged (σ, q, rounds) history (the interval is one too), so an
accountant rebuilt with ``load_state_dict`` continues with bit-identical values.

Discretisation: pessimistic estimate, so ε is an upper bound at every interval. Measured at
δ=1e-5 at 1e-4 against 3e-5 and 1e-5: ≤ 0.02% too high for ε ≥ 0.5 (q=0.01, σ=1, T=1000:
ε=1.8282) and ≤ 0.3% down to ε≈0.015 at those parameters; at far smaller ε the interval
dominates (q=1e-5, σ=1, T=1e5: 0.02382 against 0.01393 at 3e-5, a review's check: still an
upper bound). The coarsening adds little because the grid only
coarsens where the PLD is wide, i.e. where ε is large: q=0.01, σ=1, T=1000 (2e-4) +1.1e-5
relative; q=0.2, σ=1, T=1000 (1.6e-3) +5.2e-6; q=0.1, σ=0.8, T=1000 (8e-4) +2.1e-6. A fixed
1e-3 would be ~9x faster everywhere but overstates small ε by 2-25% (q=0.001, σ=0.8, T=10000:
+1.7%; q=0.001, σ=2, T=100: +25%).

Range: the cost of a PLD grows with ε (its support is the range of the privacy loss over a
grid of that interval): ≈2-6 s and ~1 GB for ε in the hundreds, and σ=0.1, q=0.1, T=300
(ε≈2200) took 31 s and 3 GB; σ=0.01 does not finish. ε is therefore only computed while it is
known to be at most ``max_epsilon`` (default 100, where a call costs at most ~10 s): by the
cheap RDP upper bound, or, where RDP is above it, by a PLD probe 100× coarser (an upper bound
too). Beyond that ``epsilon`` and ``epsilon_after`` raise ``ValueError`` (such an ε carries no
meaningful guarantee; ``RdpAccountant`` still gives a bound there).

Assumptions: Poisson sampling of clients and add/remove-one adjacency (dp-accounting's
``ADD_OR_REMOVE_ONE``; ε is the larger of the two directions). A fixed-size cohort drawn without
replacement is accounted with the same q = m/N, as an approximation. A round with q = 0 releases
nothing; a round with σ = 0 and q > 0 is not private (ε = ∞).
"""

from __future__ import annotations

import math

from privacy.pld_numpy import Pld, identity
from privacy.pld_runs import Runs, discretization_for, self_composed
from privacy.rdp import rdp_epsilon, validated, validated_delta

DEFAULT_VALUE_DISCRETIZATION_INTERVAL = 1e-4
DEFAULT_MAX_EPSILON = 100.0
# The smallest δ a PLD or PRV ε is computed at; below it the accountant refuses (an RDP
# fallback gives the bound). A review measured the float64 FFT composition's round-off against
# δ (σ=1, q=0.01, T=1000; reference: dp-accounting's pessimistic PLD composed with an
# exponentially tilted FFT, checked against an exact mixture to 1e-5): ε 3.90941 against
# 3.9143 at δ=1e-12 and 4.19036 against ≈4.2295 at 1e-13, too small; 3.59936 against ≈3.5995
# at 1e-11; below ≈1e-14 the truncated tails' mass (1e-15) gave 8.05 or ∞.
MIN_DELTA = 1e-9  # two decades above 1e-11, where ε was already 0.0002 too small
PROBE_LIMIT = 20.0  # the coarse PLD probe runs while the RDP bound is ≤ 20 × max_epsilon
_MEMO_SIZE = 3  # composed PLDs kept per accountant, keyed by the merged history


def extended(history: Runs, sigma: float, q: float, rounds: int) -> Runs:
    """``history`` after ``rounds`` more releases at (σ, q), merged with an equal last run."""
    if history and history[-1][:2] == (sigma, q):
        return (*history[:-1], (sigma, q, history[-1][2] + rounds))
    return (*history, (sigma, q, rounds))


def coarse_pld_epsilon(history: Runs, delta: float) -> float:
    """A cheap pessimistic PLD upper bound on ε (discretisation ×100 coarser than the default)."""
    interval = 100 * DEFAULT_VALUE_DISCRETIZATION_INTERVAL
    pld = None
    for sigma, q, rounds in history:
        if q == 0.0 or rounds == 0:
            continue
        run = self_composed(sigma, q, interval, rounds)
        pld = run if pld is None else pld.composed_with(run)
    return 0.0 if pld is None else pld.epsilon(delta)


class HistoryAccountant:
    """The (σ, q, rounds) run history and the ε logic shared by the PLD and PRV accountants.

    ``_epsilon`` handles what both share — no release (ε = 0), a noiseless release (ε = ∞),
    the ``max_epsilon`` guard on the cheap RDP bound, memoisation per (history, δ) — and calls
    the subclass's ``_compute(history, delta)`` for the tight value. Subclasses also give
    ``_settings()``, the constructor arguments that ``load_state_dict`` rebuilds them with.

    ``fallback_to_rdp``: where the tight computation is refused or fails (ε beyond
    ``max_epsilon``, a PRV grid too large, an opacus error), return the RDP bound instead of
    raising ``ValueError``. It is still a valid upper bound, only looser; runs use it so that a
    budget-free run with a very large ε keeps reporting one, and ``produced_by`` then names
    ``rdp`` as its source.
    """

    name: str
    sampling = "poisson"
    refusal = ""  # why an ε beyond max_epsilon is not attempted

    def __init__(self, max_epsilon: float, fallback_to_rdp: bool) -> None:
        self.max_epsilon = float(max_epsilon)
        self.fallback_to_rdp = bool(fallback_to_rdp)
        self.history: list[tuple[float, float, int]] = []  # (σ, q, rounds), merged when equal
        # (ε, the accountant that gave it: this one, or "rdp" where it fell back), per key
        self._eps_memo: dict[tuple[Runs, float], tuple[float, str]] = {}

    def _epsilon(self, history: Runs, delta: float) -> float:
        return self._epsilon_by(history, delta)[0]

    def _epsilon_by(self, history: Runs, delta: float) -> tuple[float, str]:
        """(ε, the name of the accountant whose value it is)."""
        delta = validated_delta(delta)
        if not history:
            return 0.0, self.name
        if any(sigma == 0.0 and q > 0.0 and rounds > 0 for sigma, q, rounds in history):
            return math.inf, self.name
        key = (history, delta)
        if key not in self._eps_memo:
            try:
                value = self._guarded(history, delta), self.name
            except ValueError:
                if not self.fallback_to_rdp:
                    raise
                value = rdp_epsilon(history, delta), "rdp"
            if len(self._eps_memo) >= 64:
                self._eps_memo.clear()
            self._eps_memo[key] = value
        return self._eps_memo[key]

    def _guarded(self, history: Runs, delta: float) -> float:
        """The tight ε where its computation is affordable, judged on its own merits.

        Cheap first: the RDP bound. Where it exceeds ``max_epsilon`` (RDP can be far looser
        than the PLD there), a coarse PLD probe (interval ×100, cheap, still an upper bound)
        decides: the tight ε is computed if the probe is within ``max_epsilon``; beyond
        ``PROBE_LIMIT`` × ``max_epsilon`` of RDP even the probe would be too wide to build.
        """
        if delta < MIN_DELTA:
            raise ValueError(
                f"{self.name.upper()} accounting refused at δ={delta:g} < {MIN_DELTA:g}: the "
                "float64 convolution's round-off is no longer small against δ there"
            )
        bound = rdp_epsilon(history, delta)
        if bound <= self.max_epsilon:
            return self._finite(self._compute(history, delta), bound, delta)
        probe = math.inf
        if bound <= PROBE_LIMIT * self.max_epsilon:
            probe = coarse_pld_epsilon(history, delta)
        if probe <= self.max_epsilon:
            return self._finite(self._compute(history, delta), bound, delta)
        raise ValueError(
            f"{self.name.upper()} accounting refused: the RDP bound ε={bound:.4g} and a coarse "
            f"PLD bound ε={probe:.4g} at δ={delta:g} exceed max_epsilon={self.max_epsilon:g}; "
            f"{self.refusal} Such an ε gives no meaningful guarantee; use the rdp accountant "
            "for these parameters (or raise max_epsilon)."
        )

    def _finite(self, epsilon: float, bound: float, delta: float) -> float:
        """``epsilon``, unless the mass the composition moved to +∞ (its tails' truncation)
        exceeded δ where the RDP ``bound`` is finite: ∞ then says nothing of the mechanism."""
        if math.isinf(epsilon) and math.isfinite(bound):
            raise ValueError(
                f"{self.name.upper()} accounting refused at δ={delta:g}: the mass its tails' "
                "truncation moves to +∞ exceeds δ"
            )
        return epsilon

    @property
    def rounds(self) -> int:
        return sum(rounds for _, _, rounds in self.history)

    def epsilon(self, delta: float) -> float:
        return self._epsilon(tuple(self.history), delta)

    def produced_by(self, delta: float) -> str:
        """The accountant whose value ``epsilon(delta)`` is: this one, or ``rdp`` where this one
        refused it (beyond ``max_epsilon``) and ``fallback_to_rdp`` gave the RDP bound."""
        return self._epsilon_by(tuple(self.history), delta)[1]

    def epsilon_after(self, noise_multiplier: float, sample_rate: float, delta: float) -> float:
        """ε if one more round were composed, without composing it."""
        sigma, q, _ = validated(noise_multiplier, sample_rate)
        return self._epsilon(extended(tuple(self.history), sigma, q, 1), delta)

    def state_dict(self) -> dict:
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(*self._settings())
        for sigma, q, rounds in state["history"]:
            self.step(sigma, q, int(rounds))


class PldAccountant(HistoryAccountant):
    name = "pld"
    refusal = "composing PLDs this wide takes seconds to minutes and gigabytes."

    def __init__(
        self,
        value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
        max_epsilon: float = DEFAULT_MAX_EPSILON,
        fallback_to_rdp: bool = False,
    ) -> None:
        super().__init__(max_epsilon, fallback_to_rdp)
        self.value_discretization_interval = float(value_discretization_interval)
        # PLD of history[:_closed_runs] at interval _closed_interval; only runs before the
        # last (still growing) one.
        self._closed: Pld | None = None
        self._closed_runs = 0
        self._closed_interval = self.value_discretization_interval
        self._memo: dict[Runs, tuple[float, Pld | None]] = {}

    # -- composition ---------------------------------------------------------------------------

    @staticmethod
    def _compose_run(base, sigma: float, q: float, rounds: int, interval: float):
        """``base`` composed with ``rounds`` releases at (σ, q), as ``PLDAccountant`` does it.

        None stands for "nothing released yet" (``PLDAccountant`` starts from the identity PLD
        and so does the first real composition here). σ = 0 is flagged by the caller.
        """
        if q == 0.0 or sigma == 0.0 or rounds == 0:
            return base
        run = self_composed(sigma, q, interval, rounds)
        if base is None:
            base = identity(interval)
        return base.composed_with(run)

    def _remember(self, history: Runs, interval: float, pld) -> None:
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.pop(next(iter(self._memo)))
        self._memo[history] = (interval, pld)

    def _prefix(self, before: Runs, interval: float):
        """PLD of ``before`` (``self.history[:-1]`` or ``self.history``) at ``interval``."""
        if before in self._memo and self._memo[before][0] == interval:
            return self._memo[before][1]
        if self._closed_interval != interval:  # the grid coarsened: recompose the closed runs
            self._closed, self._closed_runs, self._closed_interval = None, 0, interval
        while self._closed_runs < min(len(before), len(self.history) - 1):
            run = self.history[self._closed_runs]
            self._closed = self._compose_run(self._closed, *run, interval)
            self._closed_runs += 1
        prefix = self._closed
        for run in before[self._closed_runs :]:  # at most self.history's open last run
            prefix = self._compose_run(prefix, *run, interval)
        return prefix

    def _pld(self, history: Runs):
        """PLD of ``history``: ``self.history``, or it extended by one round."""
        if history not in self._memo:
            interval = discretization_for(history, self.value_discretization_interval)
            prefix = self._prefix(history[:-1], interval)
            self._remember(history, interval, self._compose_run(prefix, *history[-1], interval))
        return self._memo[history][1]

    def _compute(self, history: Runs, delta: float) -> float:
        pld = self._pld(history)
        return 0.0 if pld is None else pld.epsilon(delta)

    # -- the RdpAccountant interface -----------------------------------------------------------

    def step(self, noise_multiplier: float, sample_rate: float, rounds: int = 1) -> None:
        """Compose ``rounds`` releases of the q-subsampled Gaussian with multiplier σ.

        Only records the history; the PLD is composed when ε is asked for.
        """
        sigma, q, rounds = validated(noise_multiplier, sample_rate, rounds)
        if rounds == 0:
            return
        old = tuple(self.history)
        self.history = list(extended(old, sigma, q, rounds))
        if len(self.history) > len(old) and old in self._memo and self._closed_runs < len(old):
            # A new run starts: the previous full history is now closed and already composed.
            self._closed_interval, self._closed = self._memo[old]
            self._closed_runs = len(old)

    def _settings(self) -> tuple:
        return (self.value_discretization_interval, self.max_epsilon, self.fallback_to_rdp)
