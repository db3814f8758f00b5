"""configs/examples: one starting config per preset, each run for 2 rounds as a user runs it;
the `presets` listing; the example a config error names after switching algorithm.name."""

from pathlib import Path

import pytest

from algorithms.papers import PAPERS
from algorithms.presets import PRESETS
from cluster.cli.main import main
from cluster.config import ConfigError, load_config
from cluster.config.errors import EXAMPLES_DIR, example_path

# One per family runs in CI (non-private, client-level with PLD, record-level, sketched with
# adaptive clipping); the others are slow (2-8 s each on a 2-core machine).
FAST = {"fedavg", "dp_fedavg", "dp_scaffold", "dpsfl_ac"}


def test_every_preset_has_an_example_and_a_paper():
    assert {path.stem for path in Path(EXAMPLES_DIR).glob("*.yaml")} == set(PRESETS)
    assert set(PAPERS) == set(PRESETS)


@pytest.mark.parametrize(
    "preset",
    [p if p in FAST else pytest.param(p, marks=pytest.mark.slow) for p in sorted(PRESETS)],
)
def test_example_runs_two_rounds(preset, store_root, tmp_path, capsys):
    overrides = [
        "rounds=2",
        "tracking.enabled=false",
        f"data.store_root={store_root}",
        f"checkpoint.dir={tmp_path}",
    ]
    argv = ["run", example_path(preset), "--executor", "local"]
    assert main([*argv, *(a for o in overrides for a in ("--set", o))]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith(f"{preset} on synthetic_logreg")
    last = [line for line in out.splitlines() if line.startswith("round")][-1]
    assert last.startswith("round    2/2") and "acc " in last
    private = load_config(example_path(preset)).algorithm.noise_multiplier is not None
    assert ("ε " in last) == private, last  # every private example is accounted


def test_presets_lists_paper_unit_accounted_and_example(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["preset", "paper", "unit", "accounted", "example"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == set(PRESETS)
    for name, line in rows.items():
        assert PAPERS[name] in line and line.endswith(example_path(name))
    tail = {name: line.split()[-3:-1] for name, line in rows.items()}  # [unit, accounted]
    assert tail["fedavg"] == tail["fetchsgd"] == ["none", "no"]
    assert tail["dp_fedavg"] == tail["dpsfl_ac"] == ["client", "yes"]
    assert tail["dp_scaffold"] == tail["dp_fedavg_sample"] == ["record", "yes"]


@pytest.mark.parametrize(
    "preset, extra, field",
    [
        ("dp_scaffold", [], "algorithm.noise_placement"),
        ("dp_fedavg_sample", [], "algorithm.noise_placement"),
        ("fedavg", [], "algorithm.clip_norm"),
        ("scaffold", [], "algorithm.clip_norm"),
        ("fetchsgd", [], "algorithm.clip_norm"),
        (
            "fetchsgd",
            [f"algorithm.{f}=null" for f in ("clip_norm", "noise_multiplier", "noise_placement")],
            "algorithm.local.local_steps",
        ),
        ("dpsfl", [], "algorithm.local.local_steps"),
    ],
)
def test_switching_the_preset_names_its_example(preset, extra, field):
    """The quickstart with another algorithm.name fails on a field that preset refuses; the
    error names the field and the example config written for that preset."""
    with pytest.raises(ConfigError) as error:
        load_config("configs/quickstart.yaml", [f"algorithm.name={preset}", *extra])
    assert error.value.field_path == field
    assert str(error.value).endswith(f"; or start from configs/examples/{preset}.yaml")
    assert Path(example_path(preset)).is_file()
