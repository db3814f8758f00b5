"""DP-SGD vectorised across clients (algorithms/vectorized.py) is the sequential path, per client:
the same batches, the same noise draws (each client's blocks of R = noise_block_rows(d, K) rows
of its SAMPLE_NOISE stream, also with R < K), its own clip (flat or per tensor) and SCAFFOLD's
c − c_i; the weights equal up to float rounding (logistic regression and the MLP: measured
≤ 4.5e-8 absolute, 1.1e-7 relative; ``TOLERANCE`` 1e-6; the CNN below); and whole
dp_fedavg_sample / dp_scaffold runs reach the sequential run's weights, controls and ε, on one
host or two."""

import math

import pytest
import torch
from helpers import run_local, small_config

import algorithms.dpsgd as dpsgd
from actors.client_host import Kernels
from algorithms.dpsgd import (
    DpSgdGradient,
    clipped_sum,
    clipped_sums,
    noise_block_rows,
    per_example_gradients,
)
from algorithms.layout import ParamLayout
from algorithms.local import LocalTrainer, ModelObjective
from algorithms.norms import EXCESS
from algorithms.rng import Purpose, torch_generator
from algorithms.vectorized import ClientRows, _rows_per_client, train_clients, vectorizable
from models import build_model

TOLERANCE = 1e-6
UNEQUAL = [30, 1, 7, 16, 45, 30, 23]  # one record, fewer than a batch, a ragged last batch


def _objective(name: str, shape: tuple[int, ...]) -> ModelObjective:
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    return ModelObjective(model, ParamLayout.of(model))


def _clients(sizes: list[int], shape: tuple[int, ...], scale: float = 1.0):
    g = torch.Generator().manual_seed(1)
    return [
        (
            scale * torch.randn(records, *shape, generator=g),
            torch.randint(0, 10, (records,), generator=g),
        )
        for records in sizes
    ]


def _streams(n: int, purpose: Purpose, seed: int = 0) -> list[torch.Generator]:
    return [torch_generator(seed, 3, i, purpose) for i in range(n)]


def _both_paths(trainer, objective, data, corrections=None, noise_seed=0):
    """(vectorised results, sequential results) from the same streams."""
    params = ParamLayout.flatten(objective.model)
    n = len(data)
    fast = train_clients(
        trainer,
        objective,
        params,
        ClientRows.concatenated(data),
        _streams(n, Purpose.LOCAL_TRAINING),
        corrections,
        _streams(n, Purpose.SAMPLE_NOISE, noise_seed),
    )
    slow = [
        trainer.train(
            objective,
            params,
            x,
            y,
            torch_generator(0, 3, i, Purpose.LOCAL_TRAINING),
            None if corrections is None else corrections[i],
            noise_stream=lambda i=i: torch_generator(0, 3, i, Purpose.SAMPLE_NOISE),
        )
        for i, (x, y) in enumerate(data)
    ]
    return fast, slow


def _dp_trainer(
    sampling: str, scope: str, adjacency: str, local_steps: int = 4, batch_size=8, **options
) -> LocalTrainer:
    rule = DpSgdGradient(0.5, 1.3, scope=scope, adjacency=adjacency)
    steps = {"local_epochs": 1} if sampling == "epoch" else {"local_steps": local_steps}
    return LocalTrainer(
        lr=0.1, batch_size=batch_size, batch_sampling=sampling, gradient=rule, **steps, **options
    )


STEP_VARIANTS = [
    ("fresh", "flat", "replace_one"),
    ("fresh", "layer", "replace_one"),
    ("poisson", "flat", "add_remove"),  # batches of every size
    ("poisson", "layer", "add_remove"),
    ("epoch", "layer", "replace_one"),  # unequal step counts: ⌈n_i/B⌉
]


@pytest.mark.parametrize(("model", "shape"), [("logreg", (40,)), ("mlp_pca60", (60,))])
@pytest.mark.parametrize(("sampling", "scope", "adjacency"), STEP_VARIANTS)
def test_vectorized_dp_sgd_is_the_sequential_path_per_client(
    model, shape, sampling, scope, adjacency
):
    _assert_paths_agree(model, shape, sampling, scope, adjacency, TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize(("sampling", "scope", "adjacency"), STEP_VARIANTS)
def test_vectorized_dp_sgd_on_the_cnn(sampling, scope, adjacency):
    """The MNIST CNN (ReLU, max-pool): most clients within 2.4e-7, but the batched (grouped)
    convolution rounds differently with the chunk's composition (a client alone or doubled
    in a chunk: 3e-8), and where that moves a pre-activation across a ReLU or max-pool kink
    the per-example gradient jumps: measured up to 1.2e-4 (1.9e-4 relative) on one client,
    and the loss sums that follow those steps by up to 1.7e-5 relative."""
    _assert_paths_agree("mnist_cnn", (1, 28, 28), sampling, scope, adjacency, 5e-4, loss_rel=1e-4)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("sampling", "scope", "adjacency"), STEP_VARIANTS[::2])
def test_noise_in_blocks_of_fewer_rows_than_steps_keeps_the_paths_equal(
    monkeypatch, rows, sampling, scope, adjacency
):
    """``NOISE_BLOCK_FLOATS`` cut to R = 1 or 3 rows of the logistic regression's d = 410: K = 7
    steps (blocks of 3, 3, 1) or unequal K_i (epoch: 1 to 6, so R_i = min(K_i, R) varies)."""
    monkeypatch.setattr(dpsgd, "NOISE_BLOCK_FLOATS", rows * 410)
    assert noise_block_rows(410, 7) == rows
    _assert_paths_agree("logreg", (40,), sampling, scope, adjacency, TOLERANCE, local_steps=7)


def test_empty_poisson_batches_are_noise_steps_on_both_paths():
    """At B = 2 a client of n records draws an empty Poisson batch with probability
    (1 − 2/n)ⁿ ≈ e⁻² a step: the sequential path crashed on the empty step's placeholder
    outputs (one class, not the model's ten) where the vectorised one ran."""
    data = _clients(UNEQUAL, (40,))
    none_empty = math.prod((1 - (1 - min(1, 2 / len(y))) ** len(y)) ** 8 for _, y in data)
    assert none_empty < 0.01  # 8 steps of each of the 7 clients
    _assert_paths_agree("logreg", (40,), "poisson", "flat", "add_remove", TOLERANCE, 8, 1e-5, 2)


def _assert_paths_agree(
    model, shape, sampling, scope, adjacency, tolerance, local_steps=4, loss_rel=1e-5, batch=8
):
    objective = _objective(model, shape)
    trainer = _dp_trainer(
        sampling, scope, adjacency, local_steps, batch, momentum=0.5, lr_scaling="inverse_sk"
    )
    assert vectorizable(trainer, objective)
    data = _clients(UNEQUAL, shape)
    d = ParamLayout.flatten(objective.model).numel()
    corrections = 0.01 * torch.randn(len(data), d, generator=torch.Generator().manual_seed(2))
    fast, slow = _both_paths(trainer, objective, data, corrections)
    for a, b in zip(fast, slow, strict=True):
        assert (a.params - b.params).abs().max() < tolerance
        assert (a.steps, a.seen, a.correct, a.grad_evals, a.lr) == (
            b.steps,
            b.seen,
            b.correct,
            b.grad_evals,
            b.lr,
        )
        assert a.loss_sum == pytest.approx(b.loss_sum, rel=loss_rel, abs=1e-6)


def test_a_record_with_non_finite_features_contributes_a_clipped_row_on_both_paths():
    """One record of NaN or inf features (the first row of a client, which also pads its
    batches; or another) neither makes its client's update non-finite, which would drop the
    client's whole upload (one record deciding whether its client is released), nor moves it
    by more than that record's clipped row can: one step of lr·(C + C)/B from the update with
    an ordinary record in its place, the same noise in both."""
    objective = _objective("logreg", (40,))
    trainer = _dp_trainer("epoch", "flat", "replace_one")  # 8 records, B = 8: one step
    data = _clients([8, 8, 8], (40,))
    bad = [(x.clone(), y) for x, y in data]
    bad[0][0][0, 3] = float("nan")
    bad[1][0][5] = float("inf")
    bad[2][0][0, :] = -float("inf")
    ordinary, _ = _both_paths(trainer, objective, data)
    fast, slow = _both_paths(trainer, objective, bad)
    bound = 0.1 * (0.5 + 0.5) / 8
    for a, b, reference in zip(fast, slow, ordinary, strict=True):
        assert torch.isfinite(a.params).all() and torch.isfinite(b.params).all()
        assert (a.params - b.params).abs().max() < TOLERANCE
        assert 0 < float((a.params - reference.params).norm()) <= bound * (1 + 1e-5)


def _defined_noise(steps: int, dim: int, rows: int) -> torch.Tensor:
    """[K, d]: the module docstring's draw, written out: blocks of min(R, K − jR) rows of
    N(0, 1), in order, from client 0's SAMPLE_NOISE stream of round 3."""
    stream = torch_generator(0, 3, 0, Purpose.SAMPLE_NOISE)
    blocks = [
        torch.randn((min(rows, steps - first), dim), generator=stream)
        for first in range(0, steps, rows)
    ]
    return torch.cat(blocks)


def _sequential_noise(steps: int, w: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """([K, d] each step's noise, floats held in noise after each step) of a sequential round:
    empty batches of B = 1 at std κ·C·σ_g = 2·0.5·1 = 1, so that each step is its noise row
    exactly (0 + 1·ξ_k, over 1)."""
    objective = _objective("logreg", (40,))
    x, y = _clients([1], (40,))[0]
    rule = DpSgdGradient(0.5, 1.0)
    assert rule.noise_std_on_sum(2) == 1.0
    stream = lambda: torch_generator(0, 3, 0, Purpose.SAMPLE_NOISE)  # noqa: E731
    round_ = rule.for_round(None, stream, 1, steps)
    rows, held = [], []
    for _ in range(steps):
        rows.append(round_(objective, w, x[:0], y[:0])[2])
        held.append(round_._noise.numel())
    return torch.stack(rows), held


@pytest.mark.parametrize(("steps", "rows"), [(7, 7), (7, 3), (7, 1), (4, 4), (1, 1)])
def test_each_sequential_step_adds_its_row_of_the_defined_blocks(monkeypatch, steps, rows):
    """Step k adds row k mod R of block ⌊k/R⌋ (blocks of 3, 3, 1 at K = 7, R = 3), and the
    round never holds more than R·d noise floats."""
    d = 410
    monkeypatch.setattr(dpsgd, "NOISE_BLOCK_FLOATS", rows * d + d - 1)  # ⌊F/d⌋ = R
    w = ParamLayout.flatten(_objective("logreg", (40,)).model)
    noise, held = _sequential_noise(steps, w)
    assert torch.equal(noise, _defined_noise(steps, d, rows))
    assert max(held) <= rows * d


def test_where_one_block_holds_the_round_the_noise_is_the_old_single_draw():
    """R ≥ K (the default ``NOISE_BLOCK_FLOATS`` and any model of the sample-level configs):
    bit for bit the one [K, d] draw the project made before blocks, and not R = 1's draws."""
    w = ParamLayout.flatten(_objective("logreg", (40,)).model)
    assert noise_block_rows(w.numel(), 50) == 50
    old = torch.randn((50, w.numel()), generator=torch_generator(0, 3, 0, Purpose.SAMPLE_NOISE))
    noise, _ = _sequential_noise(50, w)
    assert torch.equal(noise, old)
    assert not torch.equal(_defined_noise(50, w.numel(), 1), old)


def test_a_noisy_step_differs_from_a_clean_one_by_its_noise_row_and_the_test_sees_it():
    """The sequential step k adds its noise row times its std, over B; another noise stream
    moves the weights far beyond ``TOLERANCE``, so equality above is the draws'."""
    objective = _objective("logreg", (40,))
    w = ParamLayout.flatten(objective.model)
    x, y = _clients([8], (40,))[0]
    rule = DpSgdGradient(0.5, 1.3)
    noisy = rule.for_round(None, lambda: torch_generator(0, 3, 0, Purpose.SAMPLE_NOISE), 8, 3)
    clean = DpSgdGradient(0.5, 0.0).for_round(batch_size=8)
    block = _defined_noise(3, w.numel(), 3)
    for k in range(3):
        noise = (noisy(objective, w, x, y)[2] - clean(objective, w, x, y)[2]) * 8
        torch.testing.assert_close(noise, rule.noise_std_on_sum(2) * block[k])
    with pytest.raises(ValueError, match="of 3 steps asked for step 4"):
        noisy(objective, w, x, y)
    with pytest.raises(ValueError, match="step count K"):
        rule.for_round(None, lambda: torch.Generator(), 8)
    trainer = _dp_trainer("fresh", "flat", "replace_one")
    data = _clients(UNEQUAL, (40,))
    fast, slow = _both_paths(trainer, objective, data, noise_seed=1)
    assert (
        min(float((a.params - b.params).abs().max()) for a, b in zip(fast, slow, strict=True))
        > 1e-3
    )


def test_a_chunk_counts_b_per_example_rows_and_r_noise_rows_a_client(monkeypatch):
    """B + R d-sized rows a DP-SGD client holds in a chunk (R = 0 without noise), 1 otherwise."""
    monkeypatch.setattr(dpsgd, "NOISE_BLOCK_FLOATS", 3 * 410)
    noisy = _dp_trainer("fresh", "flat", "replace_one", local_steps=7)
    assert _rows_per_client(noisy, [7, 5], 410) == 8 + 3
    assert _rows_per_client(noisy, [2], 410) == 8 + 2  # R = min(K, ⌊F/d⌋)
    clean = LocalTrainer(lr=0.1, batch_size=8, local_steps=7, gradient=DpSgdGradient(0.5, 0.0))
    assert _rows_per_client(clean, [7], 410) == 8
    assert _rows_per_client(LocalTrainer(lr=0.1, batch_size=8, local_steps=7), [7], 410) == 1


@pytest.mark.parametrize("offsets", [None, (0, 400, 410)])
def test_each_clients_clipped_per_example_gradients_have_norm_at_most_c(offsets):
    """``clipped_sums`` of one record per client is that record's clipped gradient: norm (of
    each tensor's segment) ≤ C, exactly (``algorithms.norms``), within its ``EXCESS`` of C where
    the record's norm exceeded C, untouched below; padded records (weight 0) add nothing."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(64, 3, 410, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
    weights = torch.tensor([1.0, 0.0, 0.0]).expand(64, 3)  # record 0, then two padded ones
    c = 0.7
    sums = clipped_sums(rows, weights, c, offsets)
    bounds = offsets or (0, 410)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        norms = torch.linalg.vector_norm(sums[:, start:stop].double(), dim=1)
        raw = torch.linalg.vector_norm(rows[:, 0, start:stop].double(), dim=1)
        assert float(norms.max()) <= c
        clipped = raw > c
        expected = torch.full_like(norms[clipped], c)
        torch.testing.assert_close(norms[clipped], expected, rtol=EXCESS, atol=0)
        torch.testing.assert_close(norms[~clipped], raw[~clipped])
    # and the batched sum of a client's records is the sequential ``clipped_sum`` of its own
    full = torch.ones(64, 3)
    for i in (0, 31, 63):
        torch.testing.assert_close(
            clipped_sums(rows, full, c, offsets)[i], clipped_sum(rows[i], c, offsets)
        )


@pytest.mark.parametrize("scope", ["flat", "layer"])
def test_a_vectorized_step_moves_each_client_by_its_clipped_gradient(scope):
    """End to end, σ_g = 0, one step of one record per client (large inputs: most gradients
    clipped): client i moves by η·clip_C(g_i), of norm min(‖g_i‖, C) ≤ C (each tensor's, per
    layer), never a bound shared across clients."""
    objective = _objective("logreg", (40,))
    trainer = LocalTrainer(
        lr=0.5, batch_size=1, local_steps=1, gradient=DpSgdGradient(0.3, 0.0, scope=scope)
    )
    data = _clients([1] * 12, (40,), scale=50.0)
    params = ParamLayout.flatten(objective.model)
    rows = ClientRows.concatenated(data)
    results = train_clients(trainer, objective, params, rows, _streams(12, Purpose.LOCAL_TRAINING))
    offsets = objective.layout.offsets if scope == "layer" else (0, params.numel())
    clipped = 0
    for result, (x, y) in zip(results, data, strict=True):
        step = (params - result.params).double() / 0.5
        raw = per_example_gradients(objective, params, x, y)[2][0].double()
        for start, stop in zip(offsets[:-1], offsets[1:], strict=True):
            norm, raw_norm = float(step[start:stop].norm()), float(raw[start:stop].norm())
            assert norm <= 0.3 * (1 + 1e-6)
            assert norm == pytest.approx(min(raw_norm, 0.3), rel=1e-5, abs=1e-6)  # w − w′ rounds
            clipped += raw_norm > 0.3
    assert clipped >= 6


def test_only_the_fixed_clip_is_vectorized():
    objective = _objective("logreg", (40,))
    median = LocalTrainer(
        lr=0.1,
        batch_size=8,
        local_steps=2,
        gradient=DpSgdGradient(math.nan, 1.0, "layer", clip_rule="median"),
    )
    assert not vectorizable(median, objective)  # a per-step median per client: sequential
    assert vectorizable(_dp_trainer("poisson", "flat", "add_remove"), objective)


SAMPLE_LEVEL = {
    "dp_fedavg_sample": ("algorithm.name=dp_fedavg_sample",),
    "dp_scaffold": ("algorithm.name=dp_scaffold",),
}
RUN_VARIANTS = {
    # Dirichlet clients (unequal sizes: masked batches, inverse_sk rates), per-layer clipping
    "replace_one_layer_unequal": (
        "data.partition.method=dirichlet_class",
        "data.partition.alpha=0.3",
        "data.partition.min_size=5",
        "algorithm.local.lr_scaling=inverse_sk",
        "algorithm.clip_scope=layer",
    ),
    # Poisson batches under add/remove adjacency (the PLD accountant)
    "add_remove_poisson": (
        "algorithm.local.batch_sampling=poisson",
        "algorithm.adjacency=add_remove",
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", sorted(RUN_VARIANTS))
@pytest.mark.parametrize("preset", sorted(SAMPLE_LEVEL))
def test_vectorized_runs_match_sequential_runs_and_epsilon(
    store_root, monkeypatch, preset, variant
):
    """Whole runs: the same weights (and c) up to float rounding, the same ε every round,
    vectorised on one host or two (results independent of the number of actors)."""
    import actors.client_host as client_host

    vectorized = []

    def counted(*args):
        vectorized.append(len(args[3].sizes))
        return train_clients(*args)

    monkeypatch.setattr(client_host, "train_clients", counted)
    config = small_config(
        store_root,
        *SAMPLE_LEVEL[preset],
        "algorithm.clip_norm=1.0",
        "algorithm.noise_multiplier=2.0",
        "algorithm.local.batch_size=20",
        "algorithm.local.lr=0.5",
        "rounds=3",
        *RUN_VARIANTS[variant],
    )
    runs = {
        (vectorize, hosts): run_local(config, hosts, Kernels(vectorize=vectorize))
        for vectorize, hosts in ((False, 1), (True, 1), (True, 2))
    }
    assert sum(vectorized) == 2 * 3 * 5  # both vectorised runs: every client of 3 rounds
    reference = runs[(False, 1)]
    for key, sim in runs.items():
        assert (sim.state.params - reference.state.params).abs().max() < 1e-5, key
        if preset == "dp_scaffold":
            drift = sim.state.extras["control"] - reference.state.extras["control"]
            assert drift.abs().max() < 1e-5, key
        assert [r.epsilon for r in sim.history] == [r.epsilon for r in reference.history]
        assert math.isfinite(sim.history[-1].epsilon)
