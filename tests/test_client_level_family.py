"""DP-FedSAM (+top_k), Fed-SMP and per-layer clipping: reductions, masks, noise energy, costs."""

import math

import pytest
import torch
from helpers import run_local, small_config

from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, ModelObjective, SamGradient, SgdGradient
from algorithms.lus import LocalUpdateSparsification
from algorithms.mechanism import DENSE, GaussianMechanism, UploadSupport
from algorithms.norms import EXCESS
from algorithms.pipeline import UpdatePipeline
from algorithms.regularizers import BoundedLocalUpdate, Proximal
from algorithms.sparsify import RandK, TopK
from algorithms.transforms import ClientContext, Clip

DP = ("algorithm.clip_norm=0.5", "algorithm.noise_multiplier=1.0", "rounds=3")
LAYOUT = ParamLayout(("a", "b", "c"), ((10, 10), (37,), (3,)), (0, 100, 137, 140))


def _ctx(seed=0, m=10.0, layout=LAYOUT):
    return ClientContext(
        torch.Generator().manual_seed(seed),
        m,
        layout=layout,
        round_key=(1000, 0),
    )


def _params(name, store_root, *extra):
    return run_local(small_config(store_root, f"algorithm.name={name}", *DP, *extra)).state.params


def test_rho_zero_sam_is_dp_fedavg_bit_for_bit(store_root):
    fedavg = _params("dp_fedavg", store_root, "algorithm.noise_placement=client")
    assert torch.equal(_params("dp_fedsam", store_root, "algorithm.rho=0"), fedavg)
    assert not torch.equal(_params("dp_fedsam", store_root), fedavg)  # ρ = 0.5 does differ


def test_topk_with_p_1_is_dp_fedsam_bit_for_bit(store_root):
    sam = _params("dp_fedsam", store_root)
    assert torch.equal(_params("dp_fedsam_topk", store_root, "algorithm.keep_fraction=1.0"), sam)


def test_fed_smp_runs_and_reports_the_kept_fraction(store_root):
    for name in ("fed_smp_topk", "fed_smp_randk", "dp_fedsam_topk"):
        sim = run_local(small_config(store_root, f"algorithm.name={name}", *DP))
        kept = sim.history[-1].metrics["kept_fraction"]
        assert kept == pytest.approx(0.4, abs=0.02)  # ⌊0.4·n⌋ per layer of logreg's 400 + 10
        # Client-placed dense noise makes a top-k upload dense (410 float32 values); noise on
        # rand-k's public mask keeps it sparse: (value, int32 index) pairs.
        dense = 410 * 4
        expected = 8 * (160 + 4) if name == "fed_smp_randk" else dense
        assert sim.history[-1].metrics["upload_bytes"] == expected
    # With the (trusted) server adding the noise, a top-k upload is sparse.
    server = run_local(
        small_config(
            store_root, "algorithm.name=fed_smp_topk", *DP, "algorithm.noise_placement=server"
        )
    )
    assert server.history[-1].metrics["upload_bytes"] == 8 * (160 + 4)
    assert server.history[-1].metrics["download_bytes"] == dense
    # Every byte so far, both ways: each round's uploads and one download per sampled client.
    total = 0.0
    for record in server.history:
        m = record.metrics
        total += m["upload_bytes_total"] + m["download_bytes"] * record.cohort_size
        assert m["communication_bytes"] == total


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_topk_keeps_exactly_floor_p_n_largest(scope):
    update = torch.randn(140, generator=torch.Generator().manual_seed(3))
    out = TopK(0.4, scope).apply(update, _ctx())
    segments = [(0, 140)] if scope == "global" else [(0, 100), (100, 137), (137, 140)]
    for start, stop in segments:
        part, kept = out[start:stop], math.floor(0.4 * (stop - start))
        assert int((part != 0).sum()) == kept
        if kept:  # the kept ones are the largest in magnitude
            threshold = update[start:stop].abs().sort(descending=True).values[kept - 1]
            assert bool((update[start:stop].abs()[part != 0] >= threshold).all())


def test_randk_mask_is_shared_by_every_client_of_a_round():
    a = RandK(0.4).apply(torch.ones(140), _ctx(seed=1))
    b = RandK(0.4).apply(torch.ones(140), _ctx(seed=2))
    assert torch.equal(a != 0, b != 0) and int((a != 0).sum()) == 40 + 14 + 1


@pytest.mark.parametrize(("variant", "expected"), [("dense", 1.0), ("kept", 0.4), ("noisy", 0.87)])
def test_topk_upload_noise_energy_matches_spec_000(variant, expected):
    """Tiny clean update: the upload is ~pure noise; its energy over σ²C²d/m (spec 000 §7.4).

    dense (the accounted default) keeps all of it; the paper's noise on the kept coordinates
    a fraction p; a top-k of the noisy update ≈ 87% (the largest noisy values are noise)."""
    d, m, sigma, c = 20_000, 10.0, 1.0, 1.0
    layout = ParamLayout(("w",), ((d,),), (0, d))
    topk = TopK(0.4, "layer")
    support = UploadSupport() if variant == "kept" else DENSE
    between, after = ((), (topk,)) if variant == "noisy" else ((topk,), ())
    mechanism = GaussianMechanism(Clip(c), sigma, "client", support=support, between=between)
    pipeline = UpdatePipeline(mechanism=mechanism, after=after)
    signal = torch.zeros(d)
    signal[: d // 2] = 1e-3 * torch.randn(d // 2, generator=torch.Generator().manual_seed(99))
    energy = []
    for seed in range(5):
        upload = pipeline(signal, _ctx(seed, m, layout))
        energy.append(float((upload - signal * (upload != 0)).pow(2).sum()))
    ratio = sum(energy) / 5 / (sigma**2 * c**2 * d / m)
    assert ratio == pytest.approx(expected, rel=0.03)
    assert (pipeline.unaccounted_reason is None) == (variant == "dense")


def test_per_layer_clip_bounds_each_layer_and_reports_c_sqrt_l():
    update = 10 * torch.randn(140, generator=torch.Generator().manual_seed(4))
    clip = Clip(0.5, "layer").bind(LAYOUT)
    ctx = _ctx()
    out = clip.apply(update, ctx)
    for start, stop in ((0, 100), (100, 137), (137, 140)):
        assert float(torch.linalg.vector_norm(out[start:stop].double())) <= 0.5
    # The stat reads the clip's norms, upper bounds within EXCESS (algorithms.norms).
    released = float(torch.linalg.vector_norm(out))
    assert ctx.stats["post_clip_norm"] == pytest.approx(released, rel=EXCESS)
    assert clip.output_bound(math.inf) == pytest.approx(0.5 * math.sqrt(3))
    mechanism = GaussianMechanism(Clip(0.5, "layer"), 2.0).bind(LAYOUT)
    assert mechanism.sum_noise_std == pytest.approx(2.0 * 0.5 * math.sqrt(3))
    with pytest.raises(ValueError, match="layout"):
        Clip(0.5, "layer").output_bound(math.inf)


def test_gradient_evaluations_per_step_sam_2_sgd_1():
    model = torch.nn.Linear(4, 3)
    objective = ModelObjective(model, ParamLayout.of(model))
    w = ParamLayout.flatten(model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    for rule, evals in ((SgdGradient(), 1), (SamGradient(0.5), 2), (SamGradient(0.5, True), 2)):
        before = objective.grad_evals
        rule(objective, w, x, y)
        assert objective.grad_evals - before == evals
    # SAM's gradient is the gradient at w + ρ g/‖g‖ on the same batch.
    _, _, g = objective.loss_and_grad(w, x, y)
    _, _, expected = objective.loss_and_grad(w + 0.5 * g / g.norm(), x, y)
    assert torch.allclose(SamGradient(0.5)(objective, w, x, y)[2], expected)


def test_sam_runs_report_two_evaluations_per_step(store_root):
    sim = run_local(small_config(store_root, "algorithm.name=dp_fedsam", *DP))
    assert sim.history[-1].metrics["grad_evals_per_step"] == 2.0
    assert 0 < sim.history[-1].metrics["mean_alpha"] <= 1
    assert "pre_clip_norm_p90" in sim.history[-1].metrics
    metrics = sim.history[-1].metrics  # the post-clip norm: min(‖Δ‖, C), averaged
    clip = sim.config.algorithm.clip_norm
    assert 0 < metrics["mean_post_clip_norm"] <= min(metrics["mean_pre_clip_norm"], clip)


def test_blur_lambda_0_and_lus_c_0_are_dp_fedavg_bit_for_bit(store_root):
    fedavg = _params("dp_fedavg", store_root)
    assert torch.equal(_params("dp_fedavg_blur", store_root, "algorithm.blur_lambda=0"), fedavg)
    assert torch.equal(_params("dp_fedavg_lus", store_root, "algorithm.lus_sparsity=0"), fedavg)
    blurs = _params(
        "dp_fedavg_blurs", store_root, "algorithm.blur_lambda=0", "algorithm.lus_sparsity=0"
    )
    assert torch.equal(blurs, fedavg)
    assert not torch.equal(_params("dp_fedavg_blurs", store_root), fedavg)
    by_batch = _params("dp_fedavg_lus", store_root, "algorithm.lus_gradient=batch")
    assert not torch.equal(by_batch, _params("dp_fedavg_lus", store_root))


def test_blur_with_zero_radius_is_fedprox_and_shrinks_updates(store_root):
    w0, w = torch.zeros(5), torch.arange(5.0)
    assert torch.equal(BoundedLocalUpdate(0.3, 0.0).grad(w, w0), Proximal(0.3).grad(w, w0))
    assert BoundedLocalUpdate(0.3, 100.0).grad(w, w0) is None  # inside the ball: no pull
    norms = []
    for lam in (0.0, 2.0, 8.0):
        config = small_config(
            store_root,
            "algorithm.name=dp_fedavg_blur",
            *DP,
            f"algorithm.blur_lambda={lam}",
            "algorithm.blur_bound=0.0",
            "algorithm.local.local_steps=20",
        )
        norms.append(run_local(config).history[-1].metrics["mean_pre_clip_norm"])
    assert norms[0] > norms[1] > norms[2]


def test_lus_keeps_1_minus_c_per_layer_and_beats_a_random_mask():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    layout = ParamLayout.of(model)
    objective = ModelObjective(model, layout)
    x, y = torch.randn(64, 20), torch.randint(0, 5, (64,))
    w0 = ParamLayout.flatten(model)
    w = w0.clone()
    for _ in range(30):  # local training
        w = w - 0.5 * objective.loss_and_grad(w, x, y)[2]
    delta = w - w0
    ctx = _ctx(layout=layout)
    ctx.local_gradient = lambda kind: objective.loss_and_grad(w, x, y)[2]
    out = LocalUpdateSparsification(0.7).apply(delta, ctx)
    for start, stop in zip(layout.offsets[:-1], layout.offsets[1:], strict=True):
        assert int((out[start:stop] != 0).sum()) == math.floor(0.3 * (stop - start))
    assert float(out.norm()) <= float(delta.norm())

    def loss(update):
        return float(objective.loss_and_grad(w0 + update, x, y)[0])

    # The ablation's masks (lus_score): random from ten clients' own streams, and magnitude.
    from algorithms.rng import torch_generator

    random_losses = []
    for client in range(10):
        ctx.client_stream = lambda purpose, c=client: torch_generator(0, 1, c, purpose)
        masked = LocalUpdateSparsification(0.7, score="random").apply(delta, ctx)
        for start, stop in zip(layout.offsets[:-1], layout.offsets[1:], strict=True):
            assert int((masked[start:stop] != 0).sum()) == math.floor(0.3 * (stop - start))
        random_losses.append(loss(masked))
    assert len(set(random_losses)) == 10  # each client its own mask
    assert loss(out) < min(random_losses)
    by_size = LocalUpdateSparsification(0.7, score="magnitude").apply(delta, ctx)
    for start, stop in zip(layout.offsets[:-1], layout.offsets[1:], strict=True):
        kept = by_size[start:stop] != 0
        assert float(delta[start:stop][kept].abs().min()) >= float(
            delta[start:stop][~kept].abs().max()
        )
    # Here magnitude top-k (0.976) keeps the loss lower than Taylor (1.025); random: 1.36-1.45.
    assert loss(by_size) < min(random_losses)


@pytest.mark.parametrize("score", ["magnitude", "random"])
def test_the_lus_ablation_runs_from_the_config(store_root, score):
    from helpers import run_local, small_config

    from cluster.config import ConfigError

    sets = ("algorithm.name=dp_fedavg_lus", "algorithm.clip_norm=1", "algorithm.noise_multiplier=1")
    config = small_config(store_root, *sets, f"algorithm.lus_score={score}", "rounds=2")
    (lus,) = config.build_algorithm().pipeline.before
    assert lus.score == score
    history = run_local(config).history
    assert all(r.metrics["kept_fraction"] == pytest.approx(0.3, abs=0.02) for r in history)
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *sets, "algorithm.lus_score=largest")
    assert error.value.field_path == "algorithm.lus_score"


@pytest.mark.parametrize(
    ("scope", "groups"),
    [
        ("tensor", [(0, 320), (320, 336), (336, 416), (416, 421)]),
        ("module", [(0, 336), (336, 421)]),  # each Linear's weight and bias together
        ("global", [(0, 421)]),
    ],
)
def test_lus_groups_its_top_k_per_tensor_module_or_globally(scope, groups):
    """``lus_scope`` (spec 001's configurable layer grouping): ⌊0.3·n⌋ kept in each group, the
    group's highest |g·Δ|."""
    from algorithms.transforms import module_segments

    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    layout = ParamLayout.of(model)
    assert module_segments(layout, layout.size) == [(0, 336), (336, 421)]
    delta = torch.randn(layout.size, generator=torch.Generator().manual_seed(0))
    gradient = torch.randn(layout.size, generator=torch.Generator().manual_seed(1))
    ctx = _ctx(layout=layout)
    ctx.local_gradient = lambda kind: gradient
    out = LocalUpdateSparsification(0.7, scope=scope).apply(delta, ctx)
    score = (gradient * delta).abs()
    for start, stop in groups:
        kept = out[start:stop] != 0
        assert int(kept.sum()) == math.floor(0.3 * (stop - start))
        threshold = score[start:stop].sort(descending=True).values[int(kept.sum()) - 1]
        assert bool((score[start:stop][kept] >= threshold).all())
    with pytest.raises(ValueError, match="tensor, module or global"):
        LocalUpdateSparsification(0.7, scope="layer")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_client_whose_update_is_not_finite_is_dropped(bad):
    from algorithms.client import client_round
    from models import LogisticRegression

    dp = ("algorithm.name=dp_fedavg", "algorithm.clip_norm=1", "algorithm.noise_multiplier=1")
    algorithm = small_config("unused", *dp).build_algorithm()
    torch.manual_seed(0)
    model = LogisticRegression(6, 3)
    objective, params = ModelObjective(model, ParamLayout.of(model)), ParamLayout.flatten(model)
    x, y = torch.randn(50, 6), torch.randint(0, 3, (50,))
    uploads, weight, _, report = client_round(
        algorithm, objective, params, {}, x, y, {}, 0, 0, 1, 5
    )
    assert not report.dropped and weight == 1.0 and torch.isfinite(uploads["delta"]).all()
    x[7, 2] = bad  # every record's batch that holds it poisons the update
    uploads, weight, _, report = client_round(
        algorithm, objective, params, {}, x, y, {}, 0, 0, 1, 5
    )
    assert report.dropped and weight == 0.0 and uploads == {}  # server noise: nothing owed


def test_a_dropped_client_still_uploads_its_share_of_client_placed_noise():
    """Client-placed noise is m shares of N(0, σ²C²/m): a dropped client that sent nothing
    would leave the sum with (m − 1)/m of the noise the round is charged for."""
    from algorithms.aggregate import PartialAggregate
    from algorithms.client import client_round
    from algorithms.rng import Purpose, torch_generator
    from models import LogisticRegression

    sigma, clip, m = 1.5, 2.0, 5
    dp = (
        "algorithm.name=dp_fedavg",
        f"algorithm.clip_norm={clip}",
        f"algorithm.noise_multiplier={sigma}",
        "algorithm.noise_placement=client",
    )
    algorithm = small_config("unused", *dp).build_algorithm()
    torch.manual_seed(0)
    model = LogisticRegression(6, 3)
    objective, params = ModelObjective(model, ParamLayout.of(model)), ParamLayout.flatten(model)
    x, y = torch.randn(50, 6), torch.randint(0, 3, (50,))
    x[7, 2] = math.nan
    uploads, weight, _, report = client_round(
        algorithm, objective, params, {}, x, y, {}, 0, 3, 1, m
    )
    assert report.dropped and weight == 0.0
    share = torch.randn(params.numel(), generator=torch_generator(0, 3, 1, Purpose.CLIENT_NOISE))
    assert torch.equal(uploads["delta"], sigma * clip / math.sqrt(m) * share)
    partial = PartialAggregate()
    partial.add_noise_share(uploads)
    assert partial.count == 0 and partial.weight == 0.0
    assert torch.equal(partial.sums["delta"], uploads["delta"].double())


def test_kept_counts_are_exact_where_one_minus_c_is_not_a_float():
    """1 − 0.9 = 0.0999…98 in floats: ⌊(1 − c)·n⌋ must still keep 1 of a 10-wide bias."""
    from algorithms.sparsify import topk_mask

    score = torch.arange(1.0, 1291.0)
    mask = topk_mask(score, [(0, 1280), (1280, 1290)], 1 - 0.9)
    assert int(mask[:1280].sum()) == 128 and int(mask[1280:].sum()) == 1
    assert int(topk_mask(score[:90], [(0, 90)], 1 - 0.3).sum()) == 63


def test_local_sgd_with_momentum_and_weight_decay_is_torch_optim_sgd():
    """DP-FedSAM's local optimiser (momentum 0.5, weight decay 5e-4): ``LocalTrainer.descend``
    reproduces ``torch.optim.SGD`` step for step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    objective = ModelObjective(model, ParamLayout.of(model))
    trainer = LocalTrainer(0.1, batch_size=8, local_steps=7, momentum=0.5, weight_decay=5e-4)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    w0 = ParamLayout.flatten(model)
    ours = trainer.train(objective, w0, x, y, torch.Generator().manual_seed(0)).params
    reference = torch.nn.Linear(6, 3)
    ParamLayout.of(reference).load_into(reference, w0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5, weight_decay=5e-4)
    for _ in range(7):  # one batch of 8 = the whole client: every step sees the same rows
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        optimizer.step()
    torch.testing.assert_close(ours, ParamLayout.flatten(reference), rtol=1e-6, atol=1e-7)


def test_asam_perturbs_by_rho_w_squared_g_over_the_norm_of_w_g():
    """DP-FedSAM's authors' code (ASAM): e = ρ·w²⊙g/(‖w⊙g‖ + 1e-12), G = ∇f(w + e)."""
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    objective = ModelObjective(model, ParamLayout.of(model))
    w = ParamLayout.flatten(model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    g = objective.loss_and_grad(w, x, y)[2]
    e = 0.5 * w.square() * g / ((w * g).norm() + 1e-12)
    expected = objective.loss_and_grad(w + e, x, y)[2]
    torch.testing.assert_close(SamGradient(0.5, adaptive=True)(objective, w, x, y)[2], expected)


@pytest.mark.parametrize("seed", range(20))
def test_top_k_keeps_at_least_its_share_of_each_layers_energy(seed):
    """‖top_k(Δ)‖² ≥ (⌊p·n⌋/n)·‖Δ‖² per layer (the largest squares are at least their share)."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(140, generator=g) * torch.rand(140, generator=g) ** 3
    out = TopK(0.4).apply(delta, _ctx())
    for start, stop in zip(LAYOUT.offsets[:-1], LAYOUT.offsets[1:], strict=True):
        share = math.floor(0.4 * (stop - start)) / (stop - start)
        kept = float(out[start:stop].square().sum())
        assert kept >= share * float(delta[start:stop].square().sum()) * (1 - 1e-6)


@pytest.mark.parametrize(
    ("path", "epsilon"),
    [  # specs 000 and 003: the authors' accountant (RDP, Balle et al.'s conversion)
        ("configs/papers/dpfedsam_cifar10_dir0.6.yaml", 10.80),
        ("configs/papers/dpfedsam_emnist_dir0.6.yaml", 8.51),
        ("configs/papers/dpfedpgn_cifar10_resnet10_dir0.6.yaml", 15.49),
    ],
)
def test_paper_configs_claim_the_papers_epsilon(path, epsilon):
    from cluster.claims.privacy_plan import privacy_claim
    from cluster.config import load_config

    config = load_config(path)
    claim = privacy_claim(config, config.build_algorithm())
    assert claim.epsilon(config.rounds) == pytest.approx(epsilon, rel=0.005)


def test_the_presets_defaults_are_the_papers(store_root):
    """BLUR+LUS: λ = 0.4, c = 0.7, the BLUR radius is the clip norm S, LUS runs before the
    clip and the noise (spec 001); LS: σ_ls = 0.01 (spec 003)."""
    from algorithms.regularizers import BoundedLocalUpdate
    from algorithms.smoothing import LaplacianSmoothing

    blurs = small_config(store_root, "algorithm.name=dp_fedavg_blurs", *DP).build_algorithm()
    (regularizer,) = blurs.trainer.regularizers
    assert regularizer == BoundedLocalUpdate(0.4, 0.5)  # λ, radius = C
    (lus,) = blurs.pipeline.before
    assert isinstance(lus, LocalUpdateSparsification) and lus.sparsity == 0.7
    assert blurs.pipeline.mechanism.clip.clip_norm == 0.5 and not blurs.pipeline.after
    for name in ("dp_fedavg_ls", "dp_fedpgn_ls"):
        algorithm = small_config(store_root, f"algorithm.name={name}", *DP).build_algorithm()
        assert algorithm.server.smoothing == LaplacianSmoothing(0.01, "flat")


def test_without_noise_or_clipping_the_private_presets_are_their_references(store_root):
    """σ = 0 and C = ∞: DP-FedSAM is FedSAM bit for bit (spec 000 §7)."""
    open_dp = ("algorithm.clip_norm=.inf", "algorithm.noise_multiplier=0", "rounds=3")
    dp_sam = run_local(small_config(store_root, "algorithm.name=dp_fedsam", *open_dp))
    sam = run_local(small_config(store_root, "algorithm.name=fedsam", "rounds=3"))
    assert torch.equal(dp_sam.state.params, sam.state.params)


@pytest.mark.parametrize("m", [10, 40])
def test_the_noise_on_the_mean_has_std_sigma_c_over_m(m):
    """Client-placed shares N(0, σ²C²/m) summed over m clients and divided by m: std σC/m,
    the same as the server's N(0, σ²C²) on the sum (spec 001 §7.2; checked at two m)."""
    sigma, c, d = 1.3, 0.5, 20_000
    mechanism = GaussianMechanism(Clip(c), sigma, "client")
    total = torch.zeros(d, dtype=torch.float64)
    for client in range(m):
        ctx = ClientContext(torch.Generator().manual_seed(client), float(m))
        total += mechanism.privatize(torch.zeros(d), ctx).double()
    std = float((total / m).std())
    assert std == pytest.approx(sigma * c / m, rel=0.02)


def test_upload_bytes_count_every_upload_scaffolds_control_too(store_root):
    """SCAFFOLD sends Δy_i and Δc_i (410 float32 each for the logistic regression): both count,
    so a communication budget (stop_at_bytes) or the accuracy-against-bytes plot sees them."""
    fedavg = run_local(small_config(store_root, "algorithm.name=fedavg", "rounds=1"))
    scaffold = run_local(small_config(store_root, "algorithm.name=scaffold", "rounds=1"))
    assert fedavg.history[-1].metrics["upload_bytes"] == 410 * 4
    assert scaffold.history[-1].metrics["upload_bytes"] == 2 * 410 * 4
