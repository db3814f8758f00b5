"""RDP of subsampling without replacement, and DP-SCAFFOLD's two-level accountant (spec 004 §3).

``rdp_subsampled_without_replacement`` is the RDP bound of Wang, Balle & Kasiviswanathan 2019
("Subsampled Rényi Differential Privacy and Analytical Moments Accountant"), Thm 9, for a
mechanism run on a subset of fixed size ``q·n`` drawn without replacement (with ε(∞) = ∞, so
the ternary min{·} in the j = 2 term keeps only two branches). It is evaluated at integer
orders α ≥ 2 and needs the base mechanism's RDP ε(j) at every integer j = 2..α.

``TwoLevelSampleAccountant`` is the accountant used in the DP-SCAFFOLD experiments
(Noble, Bellet & Dieuleveut 2022, ``get_epsilon_bound.py``): a Gaussian mechanism, amplified
first by data sampling (rate s, K local steps composed) and then by user sampling (rate l),
composed over T rounds and converted to (ε, δ) with the classical bound
ε = min_α [T·ε_round(α) + log(1/δ)/(α − 1)] (Mironov 2017, Prop. 3).

Caveat (spec 004 §3): the bound does not vanish as σ → ∞. Its limit is
(1/(α−1))·log(1 + 2·Σ_{j≥3} q^j·C(α, j)), a floor set by the user-sampling rate l, so the
reported ε is almost insensitive to σ_g and K. It is kept as is to reproduce the paper; tighter
accountants (``privacy.accountant``, PRV) give very different numbers.

This module depends on numpy only (no Ray, no MLflow, no scipy).
"""

from __future__ import annotations

import math

import numpy as np

from privacy.search import largest_meeting

_LOG2 = math.log(2.0)
_LOG4 = math.log(4.0)


def _log_factorials(n: int) -> np.ndarray:
    """``out[k] = log(k!)`` for k = 0..n."""
    out = np.zeros(n + 1)
    if n >= 1:
        out[1:] = np.cumsum(np.log(np.arange(1, n + 1, dtype=np.float64)))
    return out


def _logsumexp(x: np.ndarray, axis: int) -> np.ndarray:
    """Stable log Σ exp(x) along ``axis``; −∞ entries are ignored, +∞ propagates."""
    peak = np.max(x, axis=axis, keepdims=True)
    shift = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        total = np.log(np.sum(np.exp(x - shift), axis=axis, keepdims=True)) + shift
    total = np.where(np.isposinf(peak), np.inf, total)
    return np.squeeze(total, axis=axis)


def _as_integer_orders(orders: np.ndarray) -> np.ndarray:
    arr = np.asarray(orders)
    ints = np.rint(arr).astype(np.int64)
    if arr.ndim != 1 or arr.size == 0 or not np.array_equal(ints, arr) or ints.min() < 2:
        raise ValueError("orders must be a non-empty 1-D array of integers >= 2")
    return ints


def gaussian_rdp(noise_multiplier: float, orders: np.ndarray) -> np.ndarray:
    """RDP of the Gaussian mechanism with sensitivity 1 and noise std σ: ε(α) = α / (2σ²)."""
    if noise_multiplier <= 0:
        raise ValueError("noise_multiplier must be positive")
    return np.asarray(orders, dtype=np.float64) / (2.0 * float(noise_multiplier) ** 2)


def rdp_subsampled_without_replacement(
    rdp_base: np.ndarray, orders: np.ndarray, q: float
) -> np.ndarray:
    """RDP of a mechanism applied to a fraction q of the data sampled without replacement.

    Wang, Balle & Kasiviswanathan 2019, Thm 9, with ε(∞) = ∞. For an integer order α ≥ 2 the
    cumulant generating function of the subsampled mechanism is bounded by

        CGF_q(α) = log( 1 + q²·C(α, 2)·min{4(e^{ε(2)} − 1), 2e^{ε(2)}}
                          + Σ_{j=3..α} 2·q^j·C(α, j)·e^{(j−1)·ε(j)} )

    and the returned RDP is CGF_q(α) / (α − 1). Every term is formed in log space and summed
    with a log-sum-exp, so large orders and large ε(j) do not overflow.

    Args:
        rdp_base: the base mechanism's RDP at every integer order, ``rdp_base[k] = ε(k + 2)``;
            it must cover j = 2..max(orders), i.e. have length ≥ max(orders) − 1. Entries may
            be +∞ (the bound is then +∞ at every α ≥ that j).
        orders: integer orders α ≥ 2 at which to evaluate the bound (any subset, any order).
        q: sampling fraction in [0, 1].

    Returns:
        ε_q(α) for each α in ``orders`` (float64, same length as ``orders``).
    """
    alphas = _as_integer_orders(orders)
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    eps = np.asarray(rdp_base, dtype=np.float64)
    top = int(alphas.max())
    if eps.ndim != 1 or eps.size < top - 1:
        raise ValueError(f"rdp_base must hold ε(j) for j = 2..{top} (length >= {top - 1})")
    if np.any(eps < 0) or np.any(np.isnan(eps)):
        raise ValueError("rdp_base must be non-negative")
    if q == 0.0:
        return np.zeros(alphas.size)

    log_fact = _log_factorials(top)
    log_q = math.log(q)
    a = alphas[:, None].astype(np.float64)  # (n, 1)
    j = np.arange(2, top + 1)  # (top - 1,)
    log_comb = (
        log_fact[alphas][:, None]
        - log_fact[j][None, :]
        - log_fact[np.clip(alphas[:, None] - j, 0, None)]
    )

    e2 = eps[0]
    with np.errstate(divide="ignore"):
        # log min{4(e^{ε2} − 1), 2e^{ε2}} = ε2 + min{log 4 + log(1 − e^{−ε2}), log 2}
        log_min2 = e2 + min(_LOG4 + math.log(-math.expm1(-e2)) if e2 > 0 else -np.inf, _LOG2)
    eps_j = eps[: top - 1]
    with np.errstate(invalid="ignore"):  # (j − 1)·∞ is ∞; 0·∞ cannot occur (j ≥ 2)
        log_terms_j = np.where(j == 2, log_min2, _LOG2 + (j - 1) * eps_j) + j * log_q
    terms = log_comb + log_terms_j[None, :]
    terms = np.where(j[None, :] <= alphas[:, None], terms, -np.inf)  # only j ≤ α contribute

    all_terms = np.concatenate([np.zeros((alphas.size, 1)), terms], axis=1)  # the leading 1
    cgf = _logsumexp(all_terms, axis=1)
    return cgf / (a[:, 0] - 1.0)


def dpscaffold_delta(num_clients: int, train_samples_per_client: int) -> float:
    """The δ of the DP-SCAFFOLD experiments: 1 / (M · R_train), R_train = train records/user."""
    if num_clients < 1 or train_samples_per_client < 1:
        raise ValueError("num_clients and train_samples_per_client must be positive")
    return 1.0 / (num_clients * train_samples_per_client)


class TwoLevelSampleAccountant:
    """DP-SCAFFOLD's accountant: data sampling (s, K steps) nested in user sampling (l).

    One round (spec 004 §3):

    1. effective noise multiplier σ_e = σ_g·√(lM) (aggregate noise σ_g/√(lM) against the
       per-record sensitivity 1/(lM)); Gaussian RDP ε_G(α) = α / (2σ_e²);
    2. inner step: each of the K local steps samples a fraction s of a user's data without
       replacement, ε_in(α) = K · CGF_s(α)/(α − 1) with the base ε = ε_G;
    3. outer step: a fraction l of the users is sampled without replacement,
       ε_round(α) = CGF_l(α)/(α − 1) with the base ε = ε_in.

    T rounds compose to T·ε_round(α), converted with ε = min_α [T·ε_round(α) + log(1/δ)/(α−1)]
    over the integer orders α = 2..``max_order``. The paper's script refines the minimum over
    real α by linear interpolation of the CGF; the integer version implemented here reproduces
    the T values of the paper's Table 1 and its ε values to within 0.1 (see
    ``tests/test_privacy_wor.py``), and can only be (slightly) more conservative.
    """

    def __init__(
        self,
        num_clients: int,
        client_rate: float,
        data_rate: float,
        local_steps: int,
        noise_multiplier: float,
        max_order: int = 100,
    ) -> None:
        if num_clients < 1 or local_steps < 1 or max_order < 2:
            raise ValueError("num_clients, local_steps must be >= 1 and max_order >= 2")
        if not (0.0 < client_rate <= 1.0 and 0.0 < data_rate <= 1.0):
            raise ValueError("client_rate and data_rate must be in (0, 1]")
        if noise_multiplier <= 0:
            raise ValueError("noise_multiplier must be positive")
        self.num_clients = int(num_clients)
        self.client_rate = float(client_rate)
        self.data_rate = float(data_rate)
        self.local_steps = int(local_steps)
        self.noise_multiplier = float(noise_multiplier)
        self.orders = np.arange(2, int(max_order) + 1)
        self._round_rdp: np.ndarray | None = None

    @property
    def effective_noise_multiplier(self) -> float:
        """σ_e = σ_g·√(lM)."""
        return self.noise_multiplier * math.sqrt(self.client_rate * self.num_clients)

    @property
    def round_rdp(self) -> np.ndarray:
        """ε_round(α) of one round at every order in ``self.orders`` (computed once)."""
        if self._round_rdp is None:
            base = gaussian_rdp(self.effective_noise_multiplier, self.orders)
            inner = self.local_steps * rdp_subsampled_without_replacement(
                base, self.orders, self.data_rate
            )
            self._round_rdp = rdp_subsampled_without_replacement(
                inner, self.orders, self.client_rate
            )
        return self._round_rdp

    def epsilon(self, rounds: int, delta: float) -> float:
        """ε after ``rounds`` rounds at the given δ (0 for no round)."""
        if rounds < 0:
            raise ValueError("rounds must be non-negative")
        if not 0.0 < delta < 1.0:
            raise ValueError("delta must be in (0, 1)")
        if rounds == 0:
            return 0.0
        bound = rounds * self.round_rdp + math.log(1.0 / delta) / (self.orders - 1)
        return float(np.min(bound))

    def max_rounds(self, target_epsilon: float, delta: float, limit: int = 5000) -> int:
        """Largest T ≤ ``limit`` with ε(T) ≤ ``target_epsilon`` (0 if even ε(1) exceeds it).

        Doubling then bisection (``privacy.search.largest_meeting``; ε grows with T).
        """
        if limit < 0:
            raise ValueError("limit must be non-negative")
        return largest_meeting(lambda t: self.epsilon(t, delta) <= target_epsilon, int(limit))
