"""Every ε a run prints or logs is its mechanism's own, and no unaccounted run shows a number.

Walks every preset (and the papers' literal top-k variants) through ``python -m cluster run``
with MLflow on, and checks the terminal, the metrics, the tags, the privacy report and the
compare table cell against ε recomputed independently from the mechanism's σ.
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from mlflow.tracking import MlflowClient
from opacus.accountants.analysis.rdp import get_privacy_spent

from algorithms.presets import CONTROL_VARIATE_PRESETS, PRESETS, PRIVATE_PRESETS, SKETCH_PRESETS
from cluster.analysis.compare import epsilon_cell
from cluster.claims.claim_status import not_covered_by_epsilon
from cluster.cli.main import main
from cluster.config import load_config
from cluster.runtime.checkpoint import open_checkpoint
from privacy.accountant import accountant_class
from privacy.calibration import epsilon_for
from privacy.participation import epsilon_vs_server

LITERAL = {
    "dp_fedsam_topk kept": ("algorithm.name=dp_fedsam_topk", "algorithm.noise_support=kept"),
    "dp_fedsam_topk noisy": ("algorithm.name=dp_fedsam_topk", "algorithm.mask_source=noisy"),
    "fed_smp_topk kept": ("algorithm.name=fed_smp_topk", "algorithm.noise_support=kept"),
    "dp_scaffold median": ("algorithm.name=dp_scaffold", "algorithm.clip_rule=median"),
    "dp_fedpgn median": ("algorithm.name=dp_fedpgn", "algorithm.clip_rule=median"),
    "dpsfl paper": ("algorithm.name=dpsfl", "algorithm.sketch_noise=paper"),
    "dp_fedavg_blurs realised": (
        "algorithm.name=dp_fedavg_blurs",
        "algorithm.mean_denominator=realised",
    ),
}
# One batch gradient per client, a sketch small enough for the 410-parameter model.
SKETCHED = (
    "algorithm.local.local_steps=1",
    "algorithm.local.lr=1.0",
    "algorithm.sketch_cols=40",
    "algorithm.sketch_top_k=50",
)
CASES = {name: (f"algorithm.name={name}",) for name in PRESETS} | LITERAL
ROUNDS = 2
# Cases whose streams are keyed by a secret (privacy.secret_streams): one of each claim class.
SECRET_STREAMS = {"dp_fedavg", "dp_scaffold"}
# Cases whose end-to-end path another case here takes, with the part that differs checked in CI
# elsewhere: they run with the slow tests. A non-private run's terminal, tags and report come
# from the one "not private" branch; an unaccounted run's "n/a" from its config's unaccounted
# reason, each source of which keeps a case in CI: the mechanism's support (dp_fedsam_topk
# kept), the clip rule (dp_scaffold median) and the server rule (dp_fedavg_blurs realised).
# Each reason itself is checked in CI by (top-k, median, sketch):
# test_mechanism.py::test_paper_literal_topk_is_under_noised_and_unaccounted,
# test_compare.py::test_a_median_clip_runs_at_the_sigma_of_the_bases_fixed_clip,
# test_sketch.py::test_paper_variant_adds_c_sqrt_l_over_2rho_per_counter_and_is_unaccounted.
COVERED = {
    "fedsam",  # as fedavg
    "scaffold",  # as fedavg
    "dp_fedsam_topk noisy",  # as dp_fedsam_topk kept
    "fed_smp_topk kept",  # as dp_fedsam_topk kept
    "dp_fedpgn median",  # as dp_scaffold median
    "dpsfl paper",  # as dp_fedsam_topk kept
}


@pytest.fixture(scope="module")
def tracking(tmp_path_factory, sqlite_store):
    uri = sqlite_store(tmp_path_factory.mktemp("mlflow") / "m.db")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        yield MlflowClient(uri)


def _overrides(store_root, case):
    sets = [
        f"data.store_root={store_root}",
        f"checkpoint.dir={store_root}/checkpoints",
        "data.num_clients=20",
        "data.synthetic.samples_per_user=100",
        "cohort.size=5",
        "cohort.sampling=fixed",
        "algorithm.noise_placement=null",
        f"rounds={ROUNDS}",
        "algorithm.local.local_steps=2",
        "executor.kind=local",
        "tracking.experiment=claims",
        f"tracking.run_name={case}",
        *CASES[case],
        *(["privacy.secret_streams=true"] if case in SECRET_STREAMS else []),
    ]
    name = CASES[case][0].split("=")[1]
    private = name in PRIVATE_PRESETS
    median = "algorithm.clip_rule=median" in CASES[case]
    sets += [f"algorithm.clip_norm={1.0 if private and not median else 'null'}"]
    paper_noise = "algorithm.sketch_noise=paper" in CASES[case]
    sets += [f"algorithm.noise_multiplier={1.5 if private and not paper_noise else 'null'}"]
    if name in SKETCH_PRESETS:
        sets += SKETCHED
    return sets


def test_control_variate_presets_are_those_whose_algorithm_keeps_c_i(store_root):
    """The config refuses local momentum for these by name: the list must be the presets'."""
    for name in PRESETS:
        config = load_config("configs/quickstart.yaml", _overrides(store_root, name))
        assert config.build_algorithm().control_variates == (name in CONTROL_VARIATE_PRESETS)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c in COVERED else c for c in sorted(CASES)],
)
def test_every_epsilon_comes_from_the_mechanism(store_root, tracking, capsys, case, tmp_path):
    sets = _overrides(store_root, case)
    assert main(["run", "configs/quickstart.yaml", *(x for s in sets for x in ("--set", s))]) == 0
    out, err = capsys.readouterr()
    config = load_config("configs/quickstart.yaml", sets)
    (run,) = tracking.search_runs(
        [tracking.get_experiment_by_name("claims").experiment_id],
        f"params.tracking.run_name = '{case}'",
    )
    tags, metrics = run.data.tags, run.data.metrics
    parts = (case, config.algorithm.name, config.task, f"s{config.seed}", run.info.run_id[:6])
    assert run.info.run_name == " · ".join(parts)  # cluster.runtime.run_names
    description = tags["mlflow.note.content"]
    assert description.startswith(f"{ROUNDS}/{ROUNDS} rounds (completed {ROUNDS} rounds) · ")
    with open(
        tracking.download_artifacts(run.info.run_id, "privacy_report.json", str(tmp_path))
    ) as f:
        report = json.load(f)
    literal = case in LITERAL
    private = config.algorithm.name in PRIVATE_PRESETS
    if not private:
        assert "epsilon" not in metrics and tags["privacy.unit"] == "none"
        assert "ε" not in out.replace("ε ∞", "") and report["epsilon"] is None
        assert description.endswith(" · not private (no noise)")
        return
    assert tags["privacy.dp_valid"] == str(not literal).lower()
    assert tags["privacy.threat_model"] == report["threat_model"]
    row = {"private": True, "dp_valid": not literal, "epsilon": None, "epsilon_vs_server": None}
    if literal:
        assert "epsilon" not in metrics and "epsilon_vs_server" not in metrics
        reason = config.unaccounted_reason
        assert report["epsilon"] is None and reason in report["epsilon_not_available"]
        assert "privacy spent" not in out
        assert "privacy.accountant" not in tags and reason in tags["privacy.unaccounted_reason"]
        assert "ε not available" in out and "ε n/a" in out and "privacy spent" not in out
        assert re.search(r"ε\s+\d", out) is None  # no number after any ε on the terminal
        assert epsilon_cell(row) == "n/a (dp_valid=false)"
        assert description.endswith(f" · no ε: dp_valid=false ({reason})")
        return
    # What no ε covers, in every valid run: the streams' key and the noiseless diagnostics.
    secret = config.privacy.secret_streams
    assert report["not_covered_by_epsilon"] == not_covered_by_epsilon(secret)
    if secret:
        _logged_nowhere(run, tracking, store_root, out + err, tmp_path)
    assert tags["privacy.threat_model"].endswith(
        "(see the privacy report's not_covered_by_epsilon)"
    )
    if config.sample_level:
        assert f"at δ = {report['delta']:g} (" in description
        assert "; privacy unit: record; threat model: record level" in description
        _check_record_level(config, out, metrics, tags, report)
        return
    # Independently: σ from the config (= the mechanism's), q = m/N, δ = N^-1.1, fixed cohort.
    cls = accountant_class("rdp", "without_replacement")
    sigma = 1.5
    if config.algorithm.name == "dpsfl_ac":  # the clip bits' count: σ_b = 0.1 per client
        sigma = (1.5**-2 + (2 * 0.1 * 5**0.5) ** -2) ** -0.5
        assert tags["privacy.update_noise_multiplier"] == "1.5"
    expected = [epsilon_for(sigma, 0.25, t, 20**-1.1, cls) for t in (1, ROUNDS)]
    history = tracking.get_metric_history(run.info.run_id, "epsilon")
    assert [m.value for m in history] == pytest.approx(expected, rel=1e-12)
    assert report["epsilon"] == pytest.approx(expected[-1], rel=1e-12)
    assert f"ε = {expected[-1]:.3f} at δ = {20**-1.1:g}" in out
    assert f" · ε = {expected[-1]:.3f} at δ = {20**-1.1:g} (client-level, " in description
    assert f"privacy unit: client; threat model: {tags['privacy.threat_model']}" in description
    assert f"ε {expected[0]:.3f}" in out  # the progress line of round 1
    vs_server = report.get("epsilon_vs_server")
    if config.noise_placement == "client":
        expected_vs = epsilon_vs_server(sigma / 5**0.5, 0.25, ROUNDS, 20**-1.1, 2.0)
        assert vs_server == pytest.approx(expected_vs)
        assert metrics["epsilon_vs_server"] == pytest.approx(expected_vs)
        assert (
            f"ε = {expected_vs:.4g}" in out and "secure aggregation" in tags["privacy.threat_model"]
        )
    else:
        assert vs_server is None and "trusted server" in tags["privacy.threat_model"]
    row.update(epsilon=expected[-1], epsilon_vs_server=vs_server)
    assert epsilon_cell(row).startswith(f"{expected[-1]:.3f}")


def _logged_nowhere(run, tracking, store_root, terminal: str, tmp_path) -> None:
    """The key of ``run``'s secret streams (its checkpoint's) is in none of its params, tags,
    metrics or text artifacts, nor on the ``terminal``."""
    saved, _ = open_checkpoint(store_root / "checkpoints" / f"{run.info.run_id}.pt")
    key = saved["simulation"]["streams_secret"]
    folder = Path(tracking.download_artifacts(run.info.run_id, "", str(tmp_path / "all")))
    logged = [json.dumps([run.data.params, run.data.tags, run.data.metrics]), terminal]
    logged += [p.read_text() for p in folder.iterdir() if p.suffix in (".json", ".yaml")]
    assert {"config.yaml", "summary.json", "history.json"} <= {p.name for p in folder.iterdir()}
    assert not any(form in text for form in (key, str(int(key, 16))) for text in logged)
    assert run.data.params["privacy.secret_streams"] == "True"
    assert run.data.params["stream_seed"] == "None"


def _record_level_rdp(sigma, client_rate, data_rate, steps, rounds, delta):
    """ε of T rounds: K WOR-subsampled replace-one Gaussian steps (dp-accounting), mixed over
    participation in closed form, converted with Opacus's Balle et al. conversion."""
    orders = rdp_lib.DEFAULT_RDP_ORDERS
    acc = rdp_lib.RdpAccountant(orders, NeighboringRelation.REPLACE_ONE)
    n = 80  # records per client: 100 samples, 80% train
    acc.compose(
        dp_event.SampledWithoutReplacementDpEvent(
            n, round(data_rate * n), dp_event.GaussianDpEvent(sigma)
        ),
        steps,
    )
    alphas = np.array(orders)
    log_mixture = np.logaddexp(np.log1p(-client_rate), np.log(client_rate) + (alphas - 1) * acc.rdp)
    mixed = log_mixture / (alphas - 1)
    return get_privacy_spent(orders=list(orders), rdp=rounds * mixed, delta=delta)[0]


def _check_record_level(config, out, metrics, tags, report):
    """σ_g from the config, l = m/M, s = B/n, K, δ = R^-1.1 (R = 20·80 records)."""
    delta = (20 * 80) ** -1.1
    batch = config.algorithm.local.batch_size
    expected = [_record_level_rdp(1.5, 0.25, batch / 80, 2, t, delta) for t in (1, ROUNDS)]
    assert report["epsilon"] == pytest.approx(expected[-1], rel=1e-9)
    assert metrics["epsilon"] == pytest.approx(expected[-1], rel=1e-9)
    assert f"ε = {expected[-1]:.3f} at δ = {delta:g}" in out
    assert f"ε {expected[0]:.3f}" in out
    assert tags["privacy.unit"] == "record" and tags["privacy.accountant"] == "rdp"
    assert "a server that sees every upload" in tags["privacy.threat_model"]
    paper = report["epsilon_by_accountant"]["paper"]
    assert "σ_e = σ_g·√(lM)" in paper["assumption"] and paper["epsilon"] > 0
