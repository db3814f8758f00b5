"""Count sketch, FetchSGD, DPSFL and DPSFL-AC: spec 002 §7's checks and the DP-correct variant.

Expected values are spec 002 §7's (a NumPy run at d = 20k, m = 2k, l = 5, seed 42).
"""

import math
import warnings

import numpy as np
import pytest
import torch
from helpers import run_local, small_config
from scipy.stats import chi2

from algorithms.adaptive_clip import AdaptiveClip
from algorithms.aggregate import PartialAggregate
from algorithms.fetchsgd import FetchSgdServerRule
from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer
from algorithms.presets import COMPRESSION_LEVELS, ClientDP, dpsfl
from algorithms.server import ServerContext, ServerState
from algorithms.sketch import (
    MERSENNE_61,
    CountSketch,
    SketchUpload,
    hash_coefficients,
    median_over_rows,
    noise_multiplier_for_rho,
    oversized_sketch_message,
    rho_from_epsilon,
)
from algorithms.transforms import ClientContext
from benchmarks.sketch import sensitivity_report
from cluster.cli.audit import audit_config
from cluster.cli.main import main
from cluster.config import ConfigError
from cluster.runtime.checkpoint import load_checkpoint, open_checkpoint, save_checkpoint
from cluster.runtime.experiment import run_experiment
from models.resnet9 import ResNet9

SKETCH = CountSketch(20_000, 5, 2_000, 42)
# A one-gradient preset on the 410-parameter synthetic model, with a sketch that collides.
ONE_GRADIENT = (
    "algorithm.local.local_steps=1",
    "algorithm.local.lr=1.0",
    "algorithm.local.batch_size=16",
    "algorithm.sketch_cols=60",
    "algorithm.sketch_top_k=80",
    "algorithm.server_lr=0.5",
)
DPSFL = ("algorithm.name=dpsfl", *ONE_GRADIENT, "algorithm.clip_norm=1.0")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _exact_hash(row, i: int, cols: int) -> tuple[int, int]:
    """(h_j(i), ξ_j(i)) in Python's exact integers from row j's eight coefficients."""
    c = [int(value) for value in row]
    cubic = lambda c, i: (c[3] * i**3 + c[2] * i**2 + c[1] * i + c[0]) % MERSENNE_61  # noqa: E731
    return cubic(c[:4], i) % cols, 2 * (cubic(c[4:], i) % 2) - 1


def test_hashes_match_big_integer_arithmetic():
    """The vectorised 61-bit modular arithmetic agrees with Python's exact integers."""
    sketch = CountSketch(3_000_000, 3, 1_000, seed=7)
    buckets, signs = sketch.hashes()
    coefficients = hash_coefficients(3, 7)
    for i in [0, 1, 2, 12_345, 2**21 + 17, 2_999_999]:
        for j, row in enumerate(coefficients):
            assert (int(buckets[j, i]), int(signs[j, i])) == _exact_hash(row, i, 1_000)


def test_sensitivity_report_matches_a_brute_force_sketch_matrix():
    """Loads counted from the exact hashes, and the dense l·m × d matrix A of the sketch built
    from them: the bound is ≥ ‖A‖₂ = max ‖S(x)‖_F/‖x‖, and the adversarial vector on row 0's
    fullest bucket (the lowest-numbered one on a tie) attains ‖Av‖ ≥ √maxload₀."""
    dim, rows, cols, seed = 300, 3, 40, 5
    report = sensitivity_report(dim, rows, cols, seed)
    matrix = torch.zeros(rows, cols, dim, dtype=torch.float64)
    for j, row in enumerate(hash_coefficients(rows, seed)):
        for i in range(dim):
            bucket, sign = _exact_hash(row, i, cols)
            matrix[j, bucket, i] = sign
    loads = (matrix != 0).sum(dim=2)
    assert report["max_loads"] == loads.max(dim=1).values.tolist()
    assert report["bound"] == pytest.approx(math.sqrt(float(loads.max(dim=1).values.sum())))
    assert report["mean_load"] == dim / cols
    a = matrix.reshape(rows * cols, dim)
    assert float(torch.linalg.matrix_norm(a, ord=2)) <= report["bound"] + 1e-9
    fullest = int(loads[0].argmax())
    v = matrix[0, fullest] / math.sqrt(float(loads[0, fullest]))
    assert report["adversarial_norm"] == pytest.approx(float(torch.linalg.vector_norm(a @ v)))
    assert report["adversarial_norm"] ** 2 >= float(loads[0].max()) - 1e-9
    assert report["paper_shortfall"] == pytest.approx(2 * report["bound"] / math.sqrt(rows))
    assert report["noise_ratio"] == pytest.approx(report["bound"] / math.sqrt(dim / cols))


def test_every_row_loads_its_buckets_like_a_random_hash():
    """No seed leaves a row degenerate. The linear bucket hash ((a·i + b) mod P) mod m fails
    this: over consecutive indices it is a lattice, and rows of seeds 0–39 left up to 68% of
    the buckets empty (max load 48) at d = 20k, m = 2k. A random hash leaves e⁻¹⁰·m ≈ 0.1
    empty per row, and P(max load > 30) < 2000·P(Poisson(10) > 30) ≈ 1e-5 per row."""
    for seed in range(40):
        buckets, _ = CountSketch(20_000, 5, 2_000, seed).hashes()
        for row in buckets:
            loads = torch.bincount(row.long(), minlength=2_000)
            assert int((loads == 0).sum()) <= 3 and int(loads.max()) <= 30, (seed, loads.max())


def test_linearity_to_1e_12_and_exact_aggregation_in_any_grouping():
    a, b = (torch.randn(20_000, dtype=torch.float64, generator=_gen(s)) for s in (0, 1))
    assert float((SKETCH.sketch(a) + SKETCH.sketch(b) - SKETCH.sketch(a + b)).abs().max()) < 1e-12
    # Dyadic updates sum exactly: the actors' partial sums of sketches equal the sketch of the
    # dense sum bit for bit, however the clients are grouped.
    updates = torch.randint(-512, 512, (12, 20_000), generator=_gen(2)).double() / 1024
    expected = SKETCH.sketch(updates.sum(0)).flatten()
    for groups in ([12], [5, 7], [3, 3, 3, 3]):
        parts, start = [], 0
        for size in groups:
            part = PartialAggregate()
            for row in updates[start : start + size]:
                part.add({"sketch": SKETCH.sketch(row).flatten()}, 1.0)
            parts.append(part)
            start += size
        assert torch.equal(PartialAggregate.combine(parts).sums["sketch"], expected)


def test_heavy_hitters_are_recovered_and_bucket_loads_are_even():
    g = _gen(0)
    x = 0.01 * torch.randn(20_000, dtype=torch.float64, generator=g)
    spikes = torch.randperm(20_000, generator=g)[:20]
    x[spikes] = 1 + torch.rand(20, dtype=torch.float64, generator=g)
    indices, values = SKETCH.top_k(SKETCH.sketch(x), 20)
    assert set(indices.tolist()) == set(spikes.tolist())  # recall 1.0
    assert float((values - x[indices]).abs().max()) < 0.05  # spec: 0.03
    # Spec: max load about 12–13, from the linear hash's near-even lattice; the cubic's
    # loads are Poisson(10)'s, whose max over 2,000 buckets is about 22.
    assert SKETCH.max_loads().tolist() == [24, 24, 22, 23, 24]


def test_sensitivity_single_coordinate_vs_adversarial_vector():
    x = torch.zeros(20_000, dtype=torch.float64)
    x[4_321] = 1.5
    assert float(torch.linalg.vector_norm(SKETCH.sketch(x))) == pytest.approx(1.5 * math.sqrt(5))
    adversarial = SKETCH.adversarial_unit_vector()
    norm = float(torch.linalg.vector_norm(SKETCH.sketch(adversarial)))
    # Spec: 4.0 > 2.24 (its hash's max load 12, plus one per other row); here the load is 24.
    assert norm**2 == pytest.approx(24 + 4) and norm > 2 * math.sqrt(5)
    assert norm <= SKETCH.l2_sensitivity_factor
    # The bound holds for any vector: random ones stay below it.
    rows = torch.randn(50, 20_000, dtype=torch.float64, generator=_gen(3))
    for row in rows:
        ratio = torch.linalg.vector_norm(SKETCH.sketch(row)) / torch.linalg.vector_norm(row)
        assert float(ratio) <= SKETCH.l2_sensitivity_factor


def test_sparse_insert_equals_dense_and_dtypes_and_devices():
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (torch.float32, torch.float64):
            x = torch.zeros(20_000, dtype=dtype, device=device)
            idx = torch.tensor([3, 17, 9_999, 19_999], device=device)
            x[idx] = torch.tensor([1.0, -2.0, 0.5, 4.0], dtype=dtype, device=device)
            table = SKETCH.accumulate(SKETCH.zeros(dtype, device), x[idx], idx)
            assert table.dtype == dtype and torch.equal(table, SKETCH.sketch(x))


def test_rho_sigma_and_upload_ratio_at_the_paper_defaults():
    rho = rho_from_epsilon(4.0, 1e-5)
    assert rho == pytest.approx(0.2977, abs=1e-4)
    sigma = noise_multiplier_for_rho(rho) * 1.5 * math.sqrt(5)  # per counter, C = 1.5, l = 5
    assert sigma == pytest.approx(4.347, abs=1e-3)
    assert [round(rho_from_epsilon(e, 1e-5), 4) for e in (2, 6, 8, 10)] == [
        0.0800,
        0.6269,
        1.0491,
        1.5504,
    ]
    d = sum(p.numel() for p in ResNet9(10).parameters())
    assert d == 6_573_120
    ratios = [d / (5 * cols) for _, cols in COMPRESSION_LEVELS.values()]
    assert [round(r, 2) for r in ratios] == [2.63, 4.38, 6.57, 10.96, 16.43]


def test_adaptive_clip_bit_is_the_norm_threshold_2c():
    """b = 1{‖Top(clip(g)) − Top(g)‖ ≤ θ‖Top(g)‖} = 1{‖g‖ ≤ C/(1−θ)} on any index set."""
    clip = AdaptiveClip()
    g = torch.randn(1_000, dtype=torch.float64, generator=_gen(4))
    g *= 2.5 / torch.linalg.vector_norm(g)
    top = torch.topk(torch.randn(1_000, generator=_gen(5)).abs(), 50).indices  # any k indices
    for c, ratio in zip((0.5, 1.0, 1.5, 3.0), (0.8, 0.6, 0.4, 0.0), strict=True):
        clipped = g * min(1.0, c / float(torch.linalg.vector_norm(g)))
        literal_ratio = float(torch.linalg.vector_norm(clipped[top] - g[top]) / g[top].norm())
        assert literal_ratio == pytest.approx(ratio)
        assert clip.bit(2.5, c) == float(literal_ratio <= 0.5) == float(c >= 1.25)


def test_adaptive_clip_converges_to_half_the_0_9_quantile():
    """lognormal(1, 0.3) norms, N = 100, σ_b = 0.1, η_C = 0.01: C → 0.5·q₀.₉ (spec: 2.005)."""
    clip, rng = AdaptiveClip(), np.random.default_rng(0)
    c, history = 1.5, []
    for _ in range(20_000):
        norms = rng.lognormal(1.0, 0.3, size=100)
        count = sum(clip.bit(n, c) - 0.5 for n in norms) + rng.normal(0, 0.1 * 10)
        c = clip.next_clip_norm(c, count, 100)
        history.append(c)
    predicted = clip.fixed_point(math.exp(1.0 + 0.3 * 1.2815515655446004))
    assert predicted == pytest.approx(1.997, abs=1e-3)
    assert np.mean(history[-5_000:]) == pytest.approx(predicted, rel=0.01)


def _release(algorithm, updates, dim, seed):
    """The round's released sketch: each client's pipeline, summed, plus the server's S(Z)."""
    total, g = PartialAggregate(), _gen(seed)
    for row in updates:
        ctx = ClientContext(g, float(len(updates)), layout=ParamLayout(("w",), ((dim,),), (0, dim)))
        total.add({"sketch": algorithm.pipeline(row.clone(), ctx)}, 1.0)
    noise = algorithm.pipeline.server_noise(dim, None, (0, 0), g)
    ctx = ServerContext(float(len(updates)), 100, noise)
    return algorithm.server.noisy_sketch_sum(total, dim, ctx)


@pytest.mark.parametrize("placement", ["server", "client"])
def test_dense_variant_releases_the_sketch_of_sigma_c_dense_noise(store_root, placement):
    """Noise N(0, σ²C²) on the dense sum, sketched: counter (j, b) has variance σ²C²·load."""
    dim, m, sigma, c = 300, 4, 1.7, 0.5
    config = small_config(
        store_root,
        *DPSFL,
        f"algorithm.clip_norm={c}",
        f"algorithm.noise_multiplier={sigma}",
        "algorithm.sketch_cols=30",
        f"algorithm.noise_placement={placement}",
        f"cohort.size={m}",
    )
    layout = ParamLayout(("w",), ((dim,),), (0, dim))
    algorithm = config.build_algorithm().bind(layout)
    assert algorithm.pipeline.unaccounted_reason is None
    assert algorithm.mechanism.sensitivity == c  # noise on the clipped vector; sketch after
    updates = torch.randn(m, dim, generator=_gen(1))
    releases = torch.stack([_release(algorithm, updates, dim, s) for s in range(400)])
    sketch = algorithm.server.count_sketch(dim)
    loads = torch.stack([torch.bincount(r.long(), minlength=30) for r in sketch.hashes()[0]])
    clipped = sum(sketch.sketch((u * min(1, c / float(u.norm()))).double()) for u in updates)
    assert torch.allclose(releases.mean(0), clipped, atol=6 * sigma * c * loads.max() ** 0.5 / 20)
    stat = 399 * releases.var(0) / (sigma**2 * c**2 * loads.double())
    alpha = 1e-4 / loads.numel()
    assert bool(((stat > chi2.ppf(alpha / 2, 399)) & (stat < chi2.ppf(1 - alpha / 2, 399))).all())


def test_paper_variant_adds_c_sqrt_l_over_2rho_per_counter_and_is_unaccounted(store_root):
    config = small_config(store_root, *DPSFL, "algorithm.sketch_noise=paper", "cohort.size=1")
    layout = ParamLayout(("w",), ((300,),), (0, 300))
    algorithm = config.build_algorithm().bind(layout)
    reason = algorithm.pipeline.unaccounted_reason
    assert reason is not None and "one coordinate" in reason
    assert config.unaccounted_reason == reason
    update = torch.zeros(1, 300)
    releases = torch.stack([_release(algorithm, update, 300, s) for s in range(200)])
    expected = 1.0 * math.sqrt(5 / (2 * rho_from_epsilon(4.0, 1e-5)))
    assert float(releases.std()) == pytest.approx(expected, rel=0.02)


@pytest.mark.filterwarnings("ignore:a count sketch of")  # m ≫ d on purpose: no collisions
def test_fetchsgd_with_an_exact_sketch_is_fedsgd_with_server_momentum(store_root):
    """No collisions (m ≫ d), k = d and the papers' error feedback (S_e −= S(Δ), momentum kept):
    FetchSGD's step is η·(β-momentum of the mean)."""
    common = (
        *ONE_GRADIENT,
        "algorithm.sketch_cols=40000",
        "algorithm.sketch_top_k=410",
        "algorithm.sketch_feedback=subtract",
    )
    fetch = run_local(small_config(store_root, "algorithm.name=fetchsgd", *common))
    fedsgd_options = [o for o in ONE_GRADIENT if "sketch" not in o]
    fedsgd = run_local(
        small_config(
            store_root, "algorithm.name=fedavg", *fedsgd_options, "algorithm.server_momentum=0.9"
        )
    )
    assert torch.allclose(fetch.state.params, fedsgd.state.params, atol=1e-5)


def test_dpsfl_without_noise_or_clip_is_fetchsgd_bit_for_bit(store_root):
    fetch = run_local(small_config(store_root, "algorithm.name=fetchsgd", *ONE_GRADIENT))
    nonnoise = run_local(
        small_config(
            store_root,
            *DPSFL,
            "algorithm.clip_norm=.inf",
            "algorithm.noise_multiplier=0",
            "algorithm.noise_placement=server",
        )
    )
    assert torch.equal(fetch.state.params, nonnoise.state.params)


def test_dpsfl_ac_moves_c_logs_bytes_and_resumes_bit_for_bit(store_root, tmp_path, monkeypatch):
    options = (
        "algorithm.name=dpsfl_ac",
        *ONE_GRADIENT,
        "algorithm.clip_norm=1.5",
        "algorithm.noise_multiplier=1.0",
        "algorithm.clip_lr=0.2",
        f"checkpoint.dir={tmp_path}",
        "rounds=6",
    )
    straight = run_experiment(small_config(store_root, *options, "checkpoint.every=0"))
    history = straight.result.history
    clip_norms = [r.metrics["clip_norm"] for r in history]
    assert len(set(clip_norms)) == 6 and all(c > 0 for c in clip_norms)
    upload = 5 * 60 * 4 + 8  # a float32 sketch and the float64 noisy clip bit b̃_i
    assert history[0].metrics["upload_bytes"] == upload
    assert history[0].metrics["upload_bytes_total"] == 5 * upload  # the cohort of 5
    assert history[0].metrics["download_bytes"] <= 80 * 8 + 8  # sparse Δ + C
    first = run_experiment(small_config(store_root, *options, "rounds=3"))
    saved, config = open_checkpoint(first.checkpoint, ["rounds=6"])
    assert "sketch_error" in saved["simulation"]["extras"]
    resumed = run_experiment(config, resume=saved)
    assert torch.equal(resumed.result.params, straight.result.params)
    assert resumed.result.history[-1].metrics["clip_norm"] == clip_norms[-1]
    # A checkpoint from before the cubic bucket hash holds sketches of other buckets.
    with monkeypatch.context() as patch:
        patch.setattr("cluster.runtime.checkpoint.HASH_FAMILY", "linear-buckets")
        save_checkpoint(tmp_path / "linear.pt", saved["simulation"], saved["config"], None)
    with pytest.raises(ConfigError, match="hashed with the linear-buckets count-sketch hash"):
        load_checkpoint(tmp_path / "linear.pt")


def test_a_sketch_with_more_counters_than_parameters_warns_once(store_root):
    """410 parameters: 5 × 60 = 300 counters binds quietly, 5 × 100 = 500 warns, once."""
    layout = ParamLayout(("w",), ((410,),), (0, 410))
    small = small_config(store_root, "algorithm.name=fetchsgd", *ONE_GRADIENT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small.build_algorithm().bind(layout)
    big = small_config(
        store_root, "algorithm.name=fetchsgd", *ONE_GRADIENT, "algorithm.sketch_cols=100"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            big.build_algorithm().bind(layout)
    assert [str(w.message) for w in caught] == [oversized_sketch_message(5, 100, 410)]
    assert "500 counters" in str(caught[0].message) and "below d / sketch_rows = 82" in str(
        caught[0].message
    )


def test_compression_spec_scales_the_papers_levels_to_the_models_size():
    """configs/cpu/sketch_compression.yaml: CL1–CL5 at the paper's d/(l·m) (to 1%) and k/d (to
    5%: k rounded to hundreds) for the MNIST CNN's d, fetchsgd at the same sizes as dpsfl."""
    from pathlib import Path

    from cluster.analysis.compare import load_spec
    from datasets.tasks import TASKS

    base, runs = load_spec(Path("configs/cpu/sketch_compression.yaml"), [])
    cnn = TASKS[base["task"]].model((1, 28, 28), 10)
    dim = sum(p.numel() for p in cnn.parameters())
    paper_dim = 6_573_120
    for level, (paper_k, paper_m) in COMPRESSION_LEVELS.items():
        run = runs[f"dpsfl_cl{level}"]
        rows, cols, k = (run[f"algorithm.sketch_{n}"] for n in ("rows", "cols", "top_k"))
        assert dim / (rows * cols) == pytest.approx(paper_dim / (5 * paper_m), rel=0.01)
        assert k / dim == pytest.approx(paper_k / paper_dim, rel=0.05)
        fetch = runs[f"fetchsgd_cl{level}"]
        assert {n: v for n, v in fetch.items() if n != "algorithm.name"} == run
    assert (
        runs["dpsfl_cl1"]["algorithm.sketch_cols"]
        == load_spec(Path("configs/cpu/sketch.yaml"), [])[1]["dpsfl"]["algorithm.sketch_cols"]
    )


BAD_SKETCH_CONFIGS = {
    "algorithm.local.local_steps": ("algorithm.local.local_steps=5",),
    "algorithm.local.lr": ("algorithm.local.lr=0.1",),
    "algorithm.local.weight_decay": ("algorithm.local.weight_decay=5e-4",),  # u = −g, no λw
    "algorithm.sketch_cols": ("algorithm.compression_level=2",),
    "algorithm.compression_level": (
        "algorithm.compression_level=7",
        "algorithm.sketch_cols=null",
        "algorithm.sketch_top_k=null",
    ),
    "algorithm.noise_multiplier": ("algorithm.sketch_noise=paper",),
    "algorithm.paper_epsilon": ("algorithm.paper_epsilon=4",),
    "algorithm.sketch_momentum": ("algorithm.sketch_momentum=1.0",),
    "algorithm.clip_lr": ("algorithm.clip_lr=0.1",),  # a dpsfl_ac option
    "algorithm.weighting": ("algorithm.weighting=samples",),
    "algorithm.sketch_feedback": ("algorithm.sketch_feedback=zero",),  # now zero_error
}


@pytest.mark.parametrize("field", sorted(BAD_SKETCH_CONFIGS))
def test_bad_sketch_configs_name_the_field(store_root, field):
    overrides = BAD_SKETCH_CONFIGS[field]
    with pytest.raises(ConfigError) as error:
        small_config(store_root, *DPSFL, "algorithm.noise_multiplier=1", *overrides)
    assert error.value.field_path == field


def test_compression_levels_set_k_and_m():
    trainer = LocalTrainer(lr=1.0, batch_size=64, local_steps=1)
    algorithm = dpsfl(trainer, ClientDP(1.5, 1.0), compression_level=3)
    assert (algorithm.server.top_k, algorithm.server.upload.cols) == (25_000, 200_000)
    default = dpsfl(trainer, ClientDP(1.5, 1.0))
    assert (default.server.top_k, default.server.upload.cols, default.server.upload.rows) == (
        50_000,
        500_000,
        5,
    )


@pytest.mark.parametrize("variant", ["dense", "paper"])
def test_audit_passes_the_dense_variant_and_flags_the_papers(store_root, variant):
    sigma = ("algorithm.noise_multiplier=1.0",) if variant == "dense" else ()
    config = small_config(
        store_root,
        *DPSFL,
        *sigma,
        f"algorithm.sketch_noise={variant}",
        "algorithm.sketch_cols=50",
        "data.num_clients=100",
        "cohort.size=10",
    )
    result = audit_config(config, trials=1000, confidence=0.95, dim=2000, seed=0)
    assert result.dp_valid == (variant == "dense")
    if variant == "dense":
        assert result.consistent, result
        # and it has the power to see less noise than σ claims
        under = audit_config(config, 1000, 0.95, 2000, 0, noise_scale_for_testing=0.6)
        assert under.epsilon_lower_bound > under.claimed_epsilon, under
    else:
        assert result.epsilon_lower_bound > result.claimed_epsilon + 1.0, result


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7])
def test_median_over_rows_matches_torch_median(rows):
    values = torch.randn(rows, 5_000, generator=_gen(rows))
    values[-1, :100] = values[0, :100]  # ties within a column
    assert torch.equal(median_over_rows(values), values.median(dim=0).values)


@pytest.mark.parametrize("feedback", ["zero_error", "zero_error_and_momentum", "subtract"])
def test_error_feedback_zeroes_the_counters_of_delta_or_subtracts_its_sketch(feedback):
    dim = 2_000
    rule = FetchSgdServerRule(SketchUpload(5, 50, 42, dim=dim), 30, 0.9, 0.5, feedback)
    sketch = rule.count_sketch(dim)
    g = _gen(8)
    extras = {
        name: 0.1 * torch.randn(5, 50, dtype=torch.float64, generator=g)
        for name in ("sketch_momentum", "sketch_error")
    }
    state = ServerState(torch.zeros(dim), extras)
    total = PartialAggregate()
    total.add({"sketch": sketch.sketch(torch.randn(dim, generator=g)).flatten()}, 1.0)
    new = rule.step(state, total, ServerContext(1.0, 10), control=False)
    momentum = 0.9 * extras["sketch_momentum"] + total.sums["sketch"].view(5, 50)
    error = extras["sketch_error"] + 0.5 * momentum
    indices = torch.nonzero(new.params).flatten()
    assert len(indices) == 30 and torch.equal(indices, sketch.top_k(error, 30)[0])
    touched = torch.zeros(5, 50, dtype=torch.bool)
    for j in range(5):
        touched[j, sketch.hashes()[0][j, indices].long()] = True
    if feedback == "zero_error":  # FetchSGD's code: S_u as it was
        assert bool((new.extras["sketch_error"][touched] == 0).all())
        assert torch.equal(new.extras["sketch_error"][~touched], error[~touched])
        assert bool((momentum[touched] != 0).all())
        assert torch.equal(new.extras["sketch_momentum"], momentum)
    elif feedback == "zero_error_and_momentum":
        assert bool((new.extras["sketch_error"][touched] == 0).all())
        assert bool((new.extras["sketch_momentum"][touched] == 0).all())
        assert torch.equal(new.extras["sketch_error"][~touched], error[~touched])
        assert torch.equal(new.extras["sketch_momentum"][~touched], momentum[~touched])
    else:
        delta = new.params.double()
        assert torch.allclose(new.extras["sketch_error"], error - sketch.sketch(delta), atol=1e-5)
        assert torch.equal(new.extras["sketch_momentum"], momentum)


# One row, 4 columns, seed 0: h = (3, 3, 2), ξ = (−1, +1, −1); coordinates 0 and 1 collide.
# β = 0.5, η = 1, k = 2, S_u = [2, 0, 0, 6], S_e = [1, 1, 1, 3], one upload x = (3, 1, 2):
#   S(x) = [0, 0, −2, −3 + 1] = [0, 0, −2, −2]
#   S_u  = 0.5·[2, 0, 0, 6] + S(x) = [1, 0, −2, 1]
#   S_e  = [1, 1, 1, 3] + S_u      = [2, 1, −1, 4]
#   x̂    = (−4, 4, 1): Δ = (−4, 4, 0), counter 3 touched; S(Δ) = [0, 0, 0, 4 + 4]
HAND_CHECKED_FEEDBACK = {  # feedback → (S_e, S_u) after the round
    "zero_error": ([2, 1, -1, 0], [1, 0, -2, 1]),
    "zero_error_and_momentum": ([2, 1, -1, 0], [1, 0, -2, 0]),
    "subtract": ([2, 1, -1, -4], [1, 0, -2, 1]),
}


@pytest.mark.parametrize("feedback", sorted(HAND_CHECKED_FEEDBACK))
def test_error_feedback_on_a_hand_checked_sketch(feedback):
    rule = FetchSgdServerRule(SketchUpload(1, 4, 0, dim=3), 2, 0.5, 1.0, feedback)
    sketch = rule.count_sketch(3)
    buckets, signs = sketch.hashes()
    assert (buckets.tolist(), signs.tolist()) == ([[3, 3, 2]], [[-1, 1, -1]])
    extras = {
        "sketch_momentum": torch.tensor([[2.0, 0, 0, 6]], dtype=torch.float64),
        "sketch_error": torch.tensor([[1.0, 1, 1, 3]], dtype=torch.float64),
    }
    total = PartialAggregate()
    total.add({"sketch": sketch.sketch(torch.tensor([3.0, 1, 2])).flatten()}, 1.0)
    new = rule.step(ServerState(torch.zeros(3), extras), total, ServerContext(1.0, 1), False)
    error, momentum = HAND_CHECKED_FEEDBACK[feedback]
    assert new.params.tolist() == [-4, 4, 0]
    assert new.extras["sketch_error"].tolist() == [error]
    assert new.extras["sketch_momentum"].tolist() == [momentum]


def test_privacy_calculator_prints_the_papers_rho_and_counter_noise(capsys):
    assert main(["privacy", "--dpsfl-paper", "--target-epsilon", "4", "--delta", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "ρ = 0.2977" in out and "σ = C·√(l/(2ρ)) = 4.3472" in out and "dp_valid=false" in out


def test_report_gives_the_sums_noise_when_every_upload_carries_it_whole(store_root):
    """The paper variant's clients each add the whole noise (local placement): the sum of m
    uploads carries √m times the per-upload std, and the report says so."""
    from cluster.claims.privacy_plan import privacy_claim, privacy_report

    config = small_config(store_root, *DPSFL, "algorithm.sketch_noise=paper", "cohort.size=4")
    claim = privacy_claim(
        config, config.build_algorithm().bind(ParamLayout(("w",), ((300,),), (0, 300)))
    )
    assert claim.mechanism.placement == "local"
    report = privacy_report(config, claim, 3, None)
    assert report["noise_std_on_sum"] == pytest.approx(2 * claim.mechanism.sum_noise_std)
    assert report["noise_std_on_mean"] == pytest.approx(claim.mechanism.sum_noise_std / 2)
