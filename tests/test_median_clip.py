"""The DP-FedPGN authors' per-client median clip (spec 003 §1c), as an unaccounted option.

Each client clips every tensor of its update to C_i, the median of its own per-tensor norms,
and adds noise of std σ·C_i/√m itself. It runs as the authors' code does; no ε is claimed for
it (tests/test_privacy_claims.py walks a run through the CLI and MLflow)."""

import math
from itertools import pairwise

import pytest
import torch
from helpers import small_config

from algorithms.layout import ParamLayout
from algorithms.mechanism import GaussianMechanism
from algorithms.norms import EXCESS
from algorithms.transforms import ClientContext, Clip
from cluster.config import ConfigError

LAYOUT = ParamLayout(
    ("a", "b", "c", "d"), ((3000,), (2000,), (1000,), (10,)), (0, 3000, 5000, 6000, 6010)
)
NORMS = (4.0, 1.0, 2.5, 0.5)  # median of 4 (torch's, the lower middle one): 1.0


def _update(norms=NORMS) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    parts = []
    for (start, stop), norm in zip(pairwise(LAYOUT.offsets), norms, strict=True):
        part = torch.randn(stop - start, generator=g, dtype=torch.float64)
        parts.append(part * norm / part.norm())
    return torch.cat(parts)


def _tensor_norms(update: torch.Tensor) -> list[float]:
    return [float(update[start:stop].norm()) for start, stop in pairwise(LAYOUT.offsets)]


def test_each_tensor_is_clipped_to_the_clients_own_median_norm():
    clip = Clip(math.nan, "layer", rule="median").bind(LAYOUT)
    ctx = ClientContext(None, 1, layout=LAYOUT)
    update = _update()
    clipped = clip.apply(update, ctx)
    # Norms are upper bounds within EXCESS (algorithms.norms): C_i and the clips read them.
    assert ctx.stats["client_clip_norm"] == pytest.approx(1.0, rel=EXCESS)
    assert _tensor_norms(clipped) == pytest.approx([1.0, 1.0, 1.0, 0.5], rel=EXCESS)
    # Tensors within C_i are unchanged; the others keep their direction.
    assert torch.equal(clipped[6000:], update[6000:])
    assert torch.allclose(clipped[:3000], update[:3000] / 4.0)
    assert ctx.stats["clipped"] == 1.0
    assert ctx.stats["post_clip_norm"] == pytest.approx(math.sqrt(3 + 0.25), rel=EXCESS)
    # An odd count: the middle norm.
    three = ParamLayout(("a", "b", "c"), ((5,), (5,), (5,)), (0, 5, 10, 15))
    ctx = ClientContext(None, 1, layout=three)
    Clip(math.nan, "layer", rule="median").apply(
        torch.cat([torch.full((5,), v) for v in (3.0, 1.0, 2.0)]), ctx
    )
    assert ctx.stats["client_clip_norm"] == pytest.approx(2.0 * math.sqrt(5), rel=EXCESS)
    # No bound holds across clients: another client's C_i is its own.
    assert clip.output_bound(math.inf) == math.inf
    with pytest.raises(ValueError, match="scope layer"):
        Clip(math.nan, "flat", rule="median")


@pytest.mark.parametrize(("placement", "share"), [("client", 1 / math.sqrt(25)), ("local", 1.0)])
def test_each_clients_noise_has_std_sigma_times_its_median(placement, share):
    """σ·C_i/√m under client placement (the authors' σC/√(qN)), σ·C_i under local; pooled over
    6,010 coordinates and 20 draws the sample std is within 2% (≈ 6 standard errors)."""
    mechanism = GaussianMechanism(Clip(math.nan, "layer", rule="median"), 0.8, placement).bind(
        LAYOUT
    )
    assert mechanism.unaccounted_reason is not None and "median" in mechanism.unaccounted_reason
    for scale in (1.0, 3.0):  # the noise follows the client's data
        update = _update(tuple(scale * n for n in NORMS))
        noise = []
        for draw in range(20):
            ctx = ClientContext(torch.Generator().manual_seed(draw), 25, layout=LAYOUT)
            released = mechanism.privatize(update.clone(), ctx)
            noise.append(released - Clip(math.nan, "layer", rule="median").apply(update, ctx))
        expected = 0.8 * scale * 1.0 * share
        assert float(torch.stack(noise).std()) == pytest.approx(expected, rel=0.02)
    with pytest.raises(ValueError, match="only the client knows"):
        GaussianMechanism(Clip(math.nan, "layer", rule="median"), 0.8, "server")


MEDIAN = ("algorithm.name=dp_fedavg", "algorithm.clip_rule=median", "algorithm.noise_multiplier=1")


def test_the_config_defaults_to_the_authors_layout(store_root):
    """Unset, the scope is per layer and the noise the clients' (the authors' code); the run
    claims no ε and cannot be calibrated or budgeted."""
    config = small_config(store_root, *MEDIAN, "cohort.sampling=fixed")
    assert config.noise_placement == "client"
    mechanism = config.build_algorithm().mechanism
    assert (mechanism.clip.scope, mechanism.clip.rule, mechanism.placement) == (
        "layer",
        "median",
        "client",
    )
    assert "median" in config.unaccounted_reason
    with pytest.raises(ConfigError) as error:
        small_config(
            store_root,
            *MEDIAN[:2],
            "cohort.sampling=fixed",
            "privacy.calibrate=sigma",
            "privacy.target_epsilon=2",
        )
    assert error.value.field_path == "privacy.calibrate"
    assert "clip_rule: fixed with a clip_norm" in str(error.value)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (("algorithm.clip_scope=flat",), "algorithm.clip_scope"),
        (("algorithm.noise_placement=server",), "algorithm.noise_placement"),
        (("algorithm.clip_norm=1.0",), "algorithm.clip_norm"),
        (("algorithm.adjacency=add_remove",), "algorithm.adjacency"),
        (("algorithm.name=dp_fedavg_blur",), "algorithm.blur_bound"),
    ],
)
def test_bad_median_configs_name_the_field(store_root, extra, field):
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *MEDIAN, "cohort.sampling=fixed", *extra)
    assert error.value.field_path == field


def test_sketch_presets_refuse_the_median_rule(store_root):
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *MEDIAN, "cohort.sampling=fixed", "algorithm.name=dpsfl")
    assert error.value.field_path == "algorithm.clip_rule"


def test_blur_takes_its_radius_from_blur_bound_and_poisson_cohorts_are_refused(store_root):
    config = small_config(
        store_root,
        *MEDIAN,
        "cohort.sampling=fixed",
        "algorithm.name=dp_fedavg_blur",
        "algorithm.blur_bound=0.3",
    )
    (blur,) = config.build_algorithm().trainer.regularizers
    assert blur.bound == 0.3
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *MEDIAN, "cohort.sampling=poisson")
    assert error.value.field_path == "algorithm.noise_placement"
    assert "cohort.sampling: fixed" in str(error.value) and "server" not in error.value.fix


def test_the_audit_refuses_a_median_clip(tmp_path, capsys):
    from cluster.cli.main import main

    sets = [*MEDIAN, "algorithm.clip_norm=null", "algorithm.noise_placement=client"]
    sets += ["cohort.sampling=fixed", f"data.store_root={tmp_path}"]
    code = main(["audit", "configs/quickstart.yaml", *(a for s in sets for a in ("--set", s))])
    assert code == 2 and "algorithm.clip_rule = 'median'" in capsys.readouterr().err
