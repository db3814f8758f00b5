import math

import numpy as np
import pytest
import torch

from algorithms.aggregate import PartialAggregate
from algorithms.mechanism import GaussianMechanism
from algorithms.norms import EXCESS
from algorithms.pipeline import UpdatePipeline
from algorithms.server import MeanServerRule, ServerContext
from algorithms.transforms import ClientContext, Clip


def _ctx(seed=0, m=10.0):
    g = torch.Generator().manual_seed(seed)
    return ClientContext(g, m)


@pytest.mark.parametrize("seed", range(20))
def test_clip_output_norm_never_exceeds_c(seed):
    g = torch.Generator().manual_seed(seed)
    scale = 10 ** torch.empty(1).uniform_(-3, 3, generator=g).item()
    update = torch.randn(1000, generator=g) * scale
    for c in (1e-3, 0.2, 1.0, 50.0):
        out = Clip(c).apply(update, _ctx())
        assert torch.linalg.vector_norm(out.double()).item() <= c  # exactly: a norm bound


def test_clip_reuses_the_clients_norm_only_where_its_input_is_the_pipelines():
    """The client's finiteness check computed ‖Δ‖₂: the flat clip reads it instead of another
    pass, but the pipeline hands it over only when no transform runs before the mechanism (the
    clip's input is then Δ itself); after a transform the norm is computed, so the bound holds."""
    from algorithms.lus import LocalUpdateSparsification

    update = torch.full((100,), 0.5)  # ‖update‖ = 5
    ctx = _ctx()
    assert torch.allclose(Clip(1.0).apply(update, ctx, 5.0), update / 5)
    assert ctx.stats["pre_clip_norm"] == 5.0
    # A planted (wrong) norm shows which one the clip used.
    mechanism = GaussianMechanism(Clip(1.0), 0.0)
    planted = _ctx()
    UpdatePipeline(mechanism=mechanism)(update, planted, norm=2.0)
    assert planted.stats["pre_clip_norm"] == 2.0
    before = (LocalUpdateSparsification(0.0),)  # c = 0 returns the very same tensor
    computed = _ctx()
    out = UpdatePipeline(before, mechanism)(update, computed, norm=2.0)
    # The norms are upper bounds within EXCESS (algorithms.norms): the clip lands just under C.
    assert computed.stats["pre_clip_norm"] == pytest.approx(5.0, rel=EXCESS)
    assert torch.linalg.vector_norm(out).item() == pytest.approx(1.0, rel=EXCESS)


def test_clip_is_identity_under_c_and_records_stats():
    update = torch.randn(100)
    norm = torch.linalg.vector_norm(update).item()
    ctx = _ctx()
    out = Clip(norm * 1.01).apply(update, ctx)
    assert torch.equal(out, update)
    assert ctx.stats == {
        "pre_clip_norm": pytest.approx(norm, rel=EXCESS),
        "clipped": 0.0,
        "alpha": 1.0,
        "post_clip_norm": pytest.approx(norm, rel=EXCESS),
    }
    ctx = _ctx()
    out = Clip(norm / 2).apply(update, ctx)
    assert ctx.stats["clipped"] == 1.0 and ctx.stats["alpha"] == pytest.approx(0.5, rel=EXCESS)
    assert torch.allclose(out, update / 2)  # direction kept, scaled to C
    assert ctx.stats["post_clip_norm"] == pytest.approx(
        torch.linalg.vector_norm(out).item(), rel=EXCESS
    )


def test_mechanism_owns_sensitivity_and_rejects_unbounded_noise():
    pipeline = UpdatePipeline(mechanism=GaussianMechanism(Clip(0.5), 2.0, "server"))
    assert pipeline.sensitivity == 0.5
    assert pipeline.noise_multiplier == 2.0
    assert pipeline.mechanism.sum_noise_std == pytest.approx(1.0)  # σ·C on the sum
    with pytest.raises(ValueError, match="finite clip norm"):
        GaussianMechanism(Clip(math.inf), 1.0)
    assert GaussianMechanism(Clip(math.inf), 0.0).sum_noise_std == 0.0
    assert UpdatePipeline().server_noise(10, None, (0, 0), torch.Generator()) is None


def test_server_noise_on_mean_has_std_sigma_c_over_m():
    sigma, c, m, d = 0.95, 0.2, 50, 10**6
    rule = MeanServerRule()
    mechanism = GaussianMechanism(Clip(c), sigma, "server")
    noise = mechanism.server_noise(d, None, (0, 0), torch.Generator().manual_seed(7))
    ctx = ServerContext(m, 500, noise)
    total = PartialAggregate({"delta": torch.zeros(d, dtype=torch.float64)}, m, m)
    mean = rule.noisy_mean(total, d, ctx).numpy()
    expected = sigma * c / m
    assert abs(mean.std() / expected - 1) < 0.03
    assert abs(mean.mean()) < 5 * expected / np.sqrt(d)


def test_client_placed_noise_sums_to_the_same_std():
    sigma, c, m, d = 1.3, 1.0, 16, 200_000
    mechanism = GaussianMechanism(Clip(c), sigma, "client")
    total = torch.zeros(d, dtype=torch.float64)
    for i in range(m):
        total += mechanism.privatize(
            torch.zeros(d), ClientContext(torch.Generator().manual_seed(i), m)
        )
    mean_std = (total / m).std().item()
    assert abs(mean_std / (sigma * c / m) - 1) < 0.03


def test_empty_cohort_still_gets_server_noise():
    noise = GaussianMechanism(Clip(1.0), 1.0).server_noise(
        1000, None, (0, 0), torch.Generator().manual_seed(0)
    )
    mean = MeanServerRule().noisy_mean(PartialAggregate(), 1000, ServerContext(10, 100, noise))
    assert mean.abs().sum() > 0
