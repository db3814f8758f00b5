"""`python -m cluster privacy`: the calculator a researcher uses before launching a run."""

import pytest

from cluster.cli.main import main
from privacy.calibration import max_rounds
from privacy.record_level import RecordLevelAccountant


def _rows(out: str) -> dict[str, str]:
    return {
        line.split()[0]: line.split(None, 1)[1]
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("rdp", "pld", "prv", "rdp-wor")
    }


def test_epsilon_side_by_side(capsys):
    assert (
        main(["privacy", "--sigma", "0.95", "--q", "0.1", "--rounds", "200", "--delta", "0.002"])
        == 0
    )
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"rdp", "pld", "prv", "rdp-wor"}
    assert float(rows["rdp"]) == pytest.approx(8.51, rel=0.01)  # DP-FedSAM's ε (spec 000)
    # Tight accountants agree with each other and are below RDP; a fixed cohort without
    # replacement (replace-one adjacency, sensitivity 2C) costs more than Poisson.
    assert float(rows["pld"]) == pytest.approx(float(rows["prv"]), rel=0.02)
    assert float(rows["pld"]) < float(rows["rdp"]) < float(rows["rdp-wor"])


def test_a_calibrated_sigma_is_printed_rounded_up_and_meets_the_target(capsys, monkeypatch):
    """σ = 1.110337 meets ε* = 8 (RDP, q 0.1, T 300, δ 0.002), and its nearest 4-digit value
    1.11 does not (ε 8.004): the calculator prints 1.111, the σ a run calibrates rounded up.
    The RDP rows only (the tight accountants' calibrations take seconds each)."""
    import cluster.cli.privacy as privacy_cli
    from privacy.accountant import RdpAccountant, WorRdpAccountant
    from privacy.calibration import as_run_accountant, calibrate_sigma, epsilon_for

    rows = [("rdp", "rdp", "poisson"), ("rdp-wor", "rdp", "without_replacement")]
    monkeypatch.setattr(privacy_cli, "_rows", lambda: rows)
    args = ["--target-epsilon", "8", "--rounds", "300", "--q", "0.1", "--delta", "0.002"]
    assert main(["privacy", *args]) == 0
    printed = _rows(capsys.readouterr().out)
    for label, cls in (("rdp", RdpAccountant), ("rdp-wor", WorRdpAccountant)):
        sigma = float(printed[label])
        exact = calibrate_sigma(8, 0.002, 0.1, 300, as_run_accountant(cls))
        assert exact <= sigma < exact * (1 + 1e-3)
        assert epsilon_for(sigma, 0.1, 300, 0.002, cls) <= 8
    assert printed["rdp"] == "1.111"
    assert epsilon_for(1.11, 0.1, 300, 0.002, RdpAccountant) > 8


@pytest.mark.slow  # 30 s of PLD/PRV calibrations; test_calibration.py covers the searches in CI
def test_calibrated_sigma_and_round_budget(capsys):
    assert (
        main(
            [
                "privacy",
                "--target-epsilon",
                "8",
                "--rounds",
                "300",
                "--q",
                "0.1",
                "--delta",
                "0.002",
            ]
        )
        == 0
    )
    sigma = float(_rows(capsys.readouterr().out)["rdp"])
    assert 1.0 < sigma < 1.2
    assert (
        main(
            [
                "privacy",
                "--sigma",
                "0.95",
                "--target-epsilon",
                "8",
                "--q",
                "0.1",
                "--delta",
                "0.002",
            ]
        )
        == 0
    )
    assert abs(int(_rows(capsys.readouterr().out)["rdp"]) - 180) <= 2


def test_sample_level_prints_the_default_beside_the_papers_accountant(capsys):
    args = "--sample-level --l 0.05 --s 0.2 --local-steps 40 --sigma 10 --clients 100"
    args += " --samples-per-client 4000 --target-epsilon 3"
    assert main(["privacy", *args.split()]) == 0
    out = capsys.readouterr().out
    rows = {}
    for block in out.split("\n")[1:]:
        if block and not block.startswith(" "):
            name = block.split(":")[0].split(" ")[0]
        elif "max rounds" in block:
            rows[name] = int(block.rsplit(":", 1)[1])
    assert "rdp [default]: server sees every upload" in out
    assert rows["paper"] == 72  # DP-SCAFFOLD Table 1, K = 40
    assert rows["rdp"] == 58  # each record's own client's noise, against the server
    assert rows["aggregate"] > 1000  # the aggregation assumption's PLD


@pytest.mark.parametrize("k, rounds", [(1, 542), (5, 488), (10, 428), (20, 324), (40, 72)])
def test_papers_accountant_reproduces_table_1_rounds(k, rounds):
    def paper():
        return RecordLevelAccountant(0.2, k, "fresh", "replace_one", "paper", num_clients=100)

    assert max_rounds(10.0, 0.05, 2.5e-6, 3.0, paper) == rounds


def test_missing_arguments_are_named(capsys):
    assert main(["privacy", "--sigma", "1.0", "--q", "0.1", "--delta", "1e-5"]) == 2
    assert "give two of --sigma, --rounds, --target-epsilon" in capsys.readouterr().err


def test_adaptive_clipping_is_charged(capsys):
    base = ["privacy", "--sigma", "1.0", "--q", "0.05", "--rounds", "200", "--delta", "1e-5"]
    assert main(base) == 0
    fixed = _rows(capsys.readouterr().out)
    assert main([*base, "--count-noise", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "σ_eff=0.8944" in out
    adaptive = _rows(out)
    assert all(float(adaptive[k]) > float(fixed[k]) for k in fixed)


@pytest.mark.timeout(60)  # a NaN σ once looped forever in the RDP series
@pytest.mark.parametrize(
    ("given", "expect"),
    [
        (["--sigma", "nan"], "--sigma = nan: out of range; give a finite noise multiplier"),
        (["--sigma", "inf"], "--sigma = inf"),
        (["--sigma", "-1"], "--sigma = -1.0"),
        (["--q", "nan"], "--q = nan: out of range; give a sampling rate in (0, 1]"),
        (["--q", "1.5"], "--q = 1.5"),
        (["--delta", "1.5"], "--delta = 1.5: out of range; give a δ in (0, 1)"),
        (["--delta", "nan"], "--delta = nan"),
        (["--rounds", "-5"], "--rounds = -5: out of range; give at least 1 round"),
        (["--target-epsilon", "nan"], "--target-epsilon = nan"),
        (["--count-noise", "0"], "--count-noise = 0.0"),
        (["--client-cohort", "0"], "--client-cohort = 0"),
        (["--sample-level", "--l", "nan", "--s", "0.1", "--clients", "10"], "--l = nan"),
        (["--sample-level", "--l", "0.1", "--s", "2", "--clients", "10"], "--s = 2.0"),
        (["--sample-level", "--l", "0.1", "--s", "0.1", "--local-steps", "0"], "--local-steps = 0"),
        (["--sample-level", "--l", "0.1", "--s", "0.1", "--clients", "0"], "--clients = 0"),
        (["--dpsfl-paper", "--target-epsilon", "1", "--clip", "inf"], "--clip = inf"),
    ],
)
def test_out_of_range_numbers_are_refused_before_any_work(given, expect, capsys):
    """Every numeric argument outside its range is exit 2 with the flag, the value and the
    range: no hang (NaN σ), no negative ε (δ > 1), no ε of nothing (negative rounds)."""
    base = {"--sigma": "1", "--q": "0.1", "--rounds": "10", "--delta": "1e-5", "--local-steps": "1"}
    for flag in given:
        base.pop(flag, None)
    argv = ["privacy", *given, *(part for item in base.items() for part in item)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert expect in err and out == "", (out, err)
