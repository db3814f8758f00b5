"""The released sum of every private preset carries N(0, σ²S²) on every coordinate it can release.

Fixed client updates (so fixed masks), many independent noise draws: on each coordinate the
sample variance of the released sum must match σ²S² within a χ² bound (Bonferroni over the
coordinates), for every preset × flat/per-layer clipping × client/server placement. The papers'
literal top-k variants fail exactly this check and are unaccounted by construction.
"""

import math

import pytest
import torch
from helpers import small_config
from scipy.stats import chi2

from algorithms.layout import ParamLayout
from algorithms.mechanism import GaussianMechanism, UploadSupport
from algorithms.presets import CLIENT_LEVEL_PRESETS, SKETCH_PRESETS
from algorithms.transforms import ClientContext, Clip
from cluster.claims.privacy_plan import (
    ceil_significant,
    format_sigma,
    privacy_claim,
    privacy_report,
)
from cluster.config import ConfigError

LAYOUT = ParamLayout(("a", "b", "c"), ((12,), (8,), (4,)), (0, 12, 20, 24))
D, M, REPS, SIGMA, C = 24, 5, 400, 1.3, 0.5


def _updates() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    scales = torch.rand(D, generator=g) * 2
    return torch.randn(M, D, generator=g) * scales  # norms ≈ 2-4: all clipped


def _released_sums(algorithm, rep_offset=0) -> torch.Tensor:
    """REPS releases of Σ_i pipeline(u_i) + server noise, same updates and round, new noise."""
    updates, gradient = _updates(), torch.randn(D, generator=torch.Generator().manual_seed(6))
    sums = torch.empty(REPS, D, dtype=torch.float64)
    for rep in range(REPS):
        total = torch.zeros(D, dtype=torch.float64)
        noise = torch.Generator().manual_seed(rep + rep_offset)
        for i in range(M):
            ctx = ClientContext(
                noise, M, layout=LAYOUT, round_key=(3, 1), local_gradient=lambda kind: gradient
            )
            total += algorithm.pipeline(updates[i].clone(), ctx).double()
        server = algorithm.pipeline.server_noise(D, LAYOUT, (3, 1), noise)
        sums[rep] = total if server is None else total + server
    return sums


def _chi2_ok(sums: torch.Tensor, std: float, support: torch.Tensor) -> torch.Tensor:
    """Per coordinate: (REPS − 1)·s²/std² inside the two-sided χ² interval at 1e-4 overall."""
    stat = (REPS - 1) * sums.var(dim=0) / std**2
    alpha = 1e-4 / D
    low, high = chi2.ppf(alpha / 2, REPS - 1), chi2.ppf(1 - alpha / 2, REPS - 1)
    return ((stat >= low) & (stat <= high))[support]


def _algorithm(store_root, name, *extra):
    config = small_config(
        store_root,
        f"algorithm.name={name}",
        f"algorithm.clip_norm={C}",
        f"algorithm.noise_multiplier={SIGMA}",
        f"cohort.size={M}",
        *extra,
    )
    return config.build_algorithm().bind(LAYOUT)


@pytest.mark.parametrize("placement", ["client", "server"])
@pytest.mark.parametrize("scope", ["flat", "layer"])
@pytest.mark.parametrize("name", sorted(CLIENT_LEVEL_PRESETS - SKETCH_PRESETS))  # test_sketch
def test_released_sum_has_sigma_s_noise_on_every_coordinate(store_root, name, scope, placement):
    algorithm = _algorithm(
        store_root, name, f"algorithm.clip_scope={scope}", f"algorithm.noise_placement={placement}"
    )
    assert algorithm.pipeline.unaccounted_reason is None
    s = C * (math.sqrt(3) if scope == "layer" else 1.0)
    assert algorithm.mechanism.sensitivity == pytest.approx(s)
    sums = _released_sums(algorithm)
    released = sums.abs().sum(dim=0) > 0
    if name == "fed_smp_randk":  # the round's public mask: ⌊0.4·n⌋ per layer, nothing outside
        assert int(released.sum()) == 4 + 3 + 1
    else:
        assert bool(released.all())
    assert bool(_chi2_ok(sums, SIGMA * s, released).all())


@pytest.mark.parametrize(
    ("name", "literal"),
    [
        ("dp_fedsam_topk", "algorithm.noise_support=kept"),
        ("fed_smp_topk", "algorithm.noise_support=kept"),
        ("dp_fedsam_topk", "algorithm.mask_source=noisy"),
    ],
)
def test_paper_literal_topk_is_under_noised_and_unaccounted(store_root, name, literal):
    algorithm = _algorithm(store_root, name, literal)
    reason = algorithm.pipeline.unaccounted_reason
    assert reason is not None and "depends on the clients' data" in reason
    sums = _released_sums(algorithm)
    # Some coordinate carries less than σS on the sum: the χ² check rejects it.
    assert not bool(_chi2_ok(sums, SIGMA * C, torch.ones(D, dtype=torch.bool)).all())


def test_noise_on_a_client_mask_is_sigma_s_times_sqrt_n_over_m():
    """A coordinate kept by exactly one of m clients: std σS/√m on the sum (σ/√m, not σ)."""
    mechanism = GaussianMechanism(Clip(1.0), 2.0, "client", support=UploadSupport())
    m, reps = 8, 4000
    values = torch.empty(reps)
    for rep in range(reps):
        g = torch.Generator().manual_seed(rep)
        total = torch.zeros(2)
        for i in range(m):
            update = torch.tensor([0.5, 0.0]) if i == 0 else torch.tensor([0.0, 0.0])
            total += mechanism.privatize(update, ClientContext(g, m))
        values[rep] = total[0]
    assert float(values.std()) == pytest.approx(2.0 / math.sqrt(m), rel=0.05)
    with pytest.raises(ValueError, match="client-placed"):
        GaussianMechanism(Clip(1.0), 2.0, "server", support=UploadSupport())


def test_unaccounted_presets_cannot_be_calibrated_or_budgeted(store_root):
    literal = (
        "algorithm.name=fed_smp_topk",
        "algorithm.clip_norm=1",
        "algorithm.noise_support=kept",
    )
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *literal, "privacy.calibrate=sigma", "privacy.target_epsilon=2")
    assert error.value.field_path == "privacy.calibrate" and "no ε" in str(error.value)
    with pytest.raises(ConfigError) as error:
        small_config(
            store_root, *literal, "algorithm.noise_multiplier=1", "privacy.target_epsilon=2"
        )
    assert error.value.field_path == "privacy.target_epsilon"
    with pytest.raises(ConfigError) as error:
        small_config(
            store_root, *literal, "algorithm.noise_multiplier=1", "algorithm.noise_placement=server"
        )
    assert error.value.field_path == "algorithm.noise_support"
    # The accounted default calibrates, and places its noise where the config says.
    dense = small_config(
        store_root,
        "algorithm.name=fed_smp_topk",
        "algorithm.clip_norm=1",
        "algorithm.noise_placement=server",
        "privacy.calibrate=sigma",
        "privacy.target_epsilon=2",
    )
    assert dense.unaccounted_reason is None


def test_report_noise_on_the_mean_includes_sqrt_l_and_sigma_prints_rounded_up(store_root):
    config = small_config(
        store_root,
        "algorithm.name=dp_fedavg",
        "algorithm.clip_norm=0.5",
        "algorithm.noise_multiplier=2.0",
        "algorithm.clip_scope=layer",
    )
    claim = privacy_claim(config, config.build_algorithm().bind(LAYOUT))
    report = privacy_report(config, claim, 3, claim.epsilon(3))
    assert report["sensitivity"] == pytest.approx(0.5 * math.sqrt(3))
    assert report["noise_std_on_mean"] == pytest.approx(2.0 * 0.5 * math.sqrt(3) / 5)
    assert report["epsilon"] == pytest.approx(claim.epsilon(3)) and report["dp_valid"]
    # A calibrated σ is never printed below itself.
    assert ceil_significant(0.67171234) == 0.6718 and format_sigma(0.67171234) == "0.6718"
    assert ceil_significant(1.5) == 1.5 and ceil_significant(123456) == 123500
