"""A finished run is read back from a real MLflow store through MlflowClient."""

import json

import numpy as np
import pytest
from helpers import run_python, small_config
from mlflow.tracking import MlflowClient

from cluster.runtime.experiment import run_experiment


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch, sqlite_store):
    uri = sqlite_store(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def test_run_is_logged_with_params_metrics_and_artifacts(store_root, tracking_uri, tmp_path):
    config = small_config(
        store_root,
        "algorithm.name=dp_fedavg",
        "algorithm.clip_norm=0.5",
        "algorithm.noise_multiplier=1.0",
        "rounds=4",
        "eval_every=2",
        "tracking.enabled=true",
        "tracking.experiment=test-tracking",
        "cohort.sampling=poisson",
    )
    outcome = run_experiment(config)
    client = MlflowClient(tracking_uri)
    run = client.get_run(outcome.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["algorithm.clip_norm"] == "0.5"
    assert run.data.params["cohort.size"] == "5"
    # The kernels the hosts resolved, from actors.kernel_table's row (executor.vectorize: auto)
    assert run.data.params["kernels.vectorize"] == "True"
    assert run.data.params["kernels.vectorize_from"] == "table"
    assert run.data.params["kernels.table_row"].startswith("logreg/cpu: workload B")
    assert run.data.tags["algorithm"] == "dp_fedavg"
    assert run.data.tags["privacy.unit"] == "client"
    assert "version.torch" in run.data.tags and "git_commit" in run.data.tags
    assert run.data.tags["privacy.accountant"] == "pld"
    assert run.data.tags["privacy.assumption"] == "poisson-subsampled gaussian"
    assert run.data.tags["privacy.cohort_sampler"] == "poisson"
    # cluster.runtime.run_names: what ran, and its final line as the run's description
    seed, short_id = config.seed, outcome.run_id[:6]
    assert run.info.run_name == f"dp_fedavg · synthetic_logreg · s{seed} · {short_id}"
    accuracy = outcome.final_accuracy
    assert run.data.tags["mlflow.note.content"] == (
        "4/4 rounds (completed 4 rounds) · final test accuracy "
        f"{accuracy:.4f} (round 4) · ε = {outcome.epsilon:.3f} at δ = {20**-1.1:g} "
        f"(client-level, pld, poisson sampling); privacy unit: client; threat model: "
        f"{run.data.tags['privacy.threat_model']}"
    )

    epsilon = client.get_metric_history(outcome.run_id, "epsilon")
    assert [m.step for m in epsilon] == [1, 2, 3, 4]
    values = [m.value for m in epsilon]
    assert values == sorted(values) and values[-1] == pytest.approx(outcome.epsilon)
    accuracy = client.get_metric_history(outcome.run_id, "test_accuracy")
    assert [m.step for m in accuracy] == [2, 4]
    assert all(0 <= m.value <= 1 for m in accuracy)
    for name in ("seconds_per_round", "clip_fraction", "mean_pre_clip_norm"):
        assert len(client.get_metric_history(outcome.run_id, name)) == 4

    artifacts = {a.path for a in client.list_artifacts(outcome.run_id)}
    assert {"config.yaml", "curves.png", "model.pt", "history.json"} <= artifacts
    assert {"update_norms.npz", "update_norms.png"} <= artifacts
    norms = np.load(client.download_artifacts(outcome.run_id, "update_norms.npz", str(tmp_path)))
    assert list(norms["rounds"]) == [1, 2, 3, 4]
    for i, record in enumerate(outcome.result.history):  # the logged quantiles are theirs
        own = norms["norms"][norms["offsets"][i] : norms["offsets"][i + 1]]
        assert len(own) == record.metrics["clients"] - record.metrics["dropped_updates"]
        assert np.median(own) == pytest.approx(record.metrics["pre_clip_norm_p50"])
        assert own.mean() == pytest.approx(record.metrics["mean_pre_clip_norm"])
    partition = {a.path for a in client.list_artifacts(outcome.run_id, "partition")}
    assert partition == {
        "partition/class_histogram.png",
        "partition/client_sizes.png",
        "partition/partition_summary.json",
    }
    with open(client.download_artifacts(outcome.run_id, "privacy_report.json", str(tmp_path))) as f:
        report = json.load(f)
    assert report["unit"] == "client" and report["accountant"] == "pld"
    assert report["rounds"] == 4 and report["sample_rate"] == 0.25
    assert report["noise_multiplier"] == 1.0 and report["clip_norm"] == 0.5
    assert report["delta"] == pytest.approx(20**-1.1)  # default δ = population^-1.1
    assert report["dp_valid"] is True and "trusted server" in report["threat_model"]
    assert report["epsilon"] == pytest.approx(outcome.epsilon)
    assert report["noise_cohort_size"] == 5 and report["noise_std_on_mean"] == 0.1
    assert report["cohort_sampler"] == "poisson" and report["sampling_assumption"] == "poisson"
    by = report["epsilon_by_accountant"]
    assert by["pld"] == pytest.approx(outcome.epsilon) and by["rdp"] >= by["pld"]
    local = client.download_artifacts(outcome.run_id, "config.yaml", str(tmp_path))
    with open(local) as f:
        assert "dp_fedavg" in f.read()


def test_the_tracking_process_writes_rounds_in_order_and_raises_its_error_at_the_next_wait(
    tracking_uri,
):
    """Rounds are handed on without waiting and written in order; a write that fails is raised
    at the next call that waits (flush), later writes are skipped, and the run still ends."""
    from cluster.runtime.records import RoundRecord
    from cluster.tracking.process import TrackingError, TrackingRun

    run = TrackingRun.open(tracking_uri, "test-process", "r", {"a": "1"}, {"t": "x"})
    for step in (1, 2, 3):
        run.log_round(RoundRecord(round=step, cohort_size=5, seconds=0.1, metrics={"m": step}))
    run.flush()
    client = MlflowClient(tracking_uri)
    history = client.get_metric_history(run.run_id, "m")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    run.log_round(RoundRecord(round=4, cohort_size=5, seconds=0.1, metrics={"bad?name": 1.0}))
    run.log_round(RoundRecord(round=5, cohort_size=5, seconds=0.1, metrics={"m": 5}))
    with pytest.raises(TrackingError, match=r"bad\?name"):
        run.flush()
    run.abandon("FAILED")  # raises nothing: the run's own error is the one to report
    assert run._process.returncode == 0  # the process exited with its run
    assert client.get_run(run.run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.run_id, "m")] == [1, 2, 3]
    assert run.run_page().endswith(f"/runs/{run.run_id}?workflowType=machine_learning")


def test_rounds_are_written_together_and_a_refused_batch_keeps_the_rounds_before_it(
    tracking_uri, monkeypatch
):
    """The tracking process writes the rounds it has received in few ``log_batch`` calls (each is
    an SQLite transaction): within MLflow's 1,000-metric limit, each round stamped with its own
    time. A batch with a bad round is retried round by round: the rounds before it are kept."""
    from cluster.runtime.records import RoundRecord
    from cluster.tracking.tracker import MlflowTracker

    tracker = MlflowTracker(tracking_uri, "test-batches", "r", {}, {})
    calls = []
    log_batch = tracker.client.log_batch
    monkeypatch.setattr(
        tracker.client, "log_batch", lambda *a, **k: calls.append(1) or log_batch(*a, **k)
    )
    metrics = {f"m{i}": float(i) for i in range(23)}  # 25 per round with the two always logged
    rounds = [
        (RoundRecord(round=r, cohort_size=5, seconds=0.1, metrics=metrics), 1_000 + r)
        for r in range(1, 51)
    ]
    tracker.log_rounds(rounds[:40])  # 40 × 25 = 1,000 metrics: MLflow's limit, one call
    assert len(calls) == 1
    tracker.log_rounds(rounds)  # the first 40 already written: skipped
    assert len(calls) == 2
    fresh = MlflowTracker(tracking_uri, "test-batches", "r2", {}, {})
    monkeypatch.setattr(
        fresh.client, "log_batch", lambda *a, **k: calls.append(2) or log_batch(*a, **k)
    )
    fresh.log_rounds(rounds)  # 1,250 metrics: 40 rounds, then 10
    assert calls.count(2) == 2
    fresh.client.set_terminated(fresh.run_id)
    history = tracker.client.get_metric_history(tracker.run_id, "m3")
    assert sorted((m.step, m.timestamp, m.value) for m in history) == [
        (r, 1_000 + r, 3.0) for r in range(1, 51)
    ]
    tracker.log_rounds(rounds[:5])  # already written (a resumed run recomputes them): skipped
    assert calls.count(1) == 2
    bad = RoundRecord(round=53, cohort_size=5, seconds=0.1, metrics={"bad?name": 1.0})
    later = [
        RoundRecord(round=r, cohort_size=5, seconds=0.1, metrics={"m3": 3.0}) for r in (51, 52, 54)
    ]
    with pytest.raises(Exception, match=r"bad\?name"):
        tracker.log_rounds([(later[0], 1), (later[1], 2), (bad, 3), (later[2], 4)])
    steps = sorted(m.step for m in tracker.client.get_metric_history(tracker.run_id, "m3"))
    assert steps == [*range(1, 53)] and tracker.logged_through == 52
    # A node lost while round 50's checkpoint was written: round 50 recomputed, logged already,
    # but its recovery's time is new (it was lost before); nothing else is logged again.
    recovered = {"m3": 9.0, "recovery_seconds": 4.5, "rounds_replayed": 3.0}
    again = RoundRecord(round=50, cohort_size=5, seconds=0.1, metrics=recovered)
    tracker.log_rounds([(again, 7_000)])
    history = tracker.client.get_metric_history(tracker.run_id, "recovery_seconds")
    assert [(m.step, m.value) for m in history] == [(50, 4.5)]
    assert [m.value for m in tracker.client.get_metric_history(tracker.run_id, "m3")].count(
        9.0
    ) == 0
    assert tracker.logged_through == 52
    tracker.client.set_terminated(tracker.run_id)


def test_serve_writes_rounds_together_and_before_it_exits(monkeypatch):
    """The tracking process's loop with a recording tracker: rounds sent in a burst are one
    write, done before a flush answers; rounds still held when the driver closes its end, or
    dies leaving a reply unread (ECONNRESET, not EOF), are written before the loop ends."""
    import socket
    import threading
    import time
    from multiprocessing.connection import Connection

    import cluster.tracking.service as tp

    writes = []

    class Recorder:
        run_id, experiment_id = "r", "e"

        def log_rounds(self, rounds):
            writes.append([record for record, _ in rounds])

    monkeypatch.setattr(tp, "_open", lambda *args: Recorder())

    def start():
        ours, theirs = socket.socketpair()
        process = threading.Thread(target=tp.serve, args=(Connection(theirs.detach()),))
        process.start()
        return Connection(ours.detach()), process

    driver, process = start()
    driver.send(("open", (), True))
    assert driver.recv() == ("ok", ("r", "e"))
    for r in (1, 2, 3):
        driver.send(("log_round", (r, 0), False))
    driver.send(("flush", (), True))
    assert driver.recv() == ("ok", None) and writes == [[1, 2, 3]]
    driver.send(("log_round", (4, 0), False))
    driver.close()
    process.join(10)
    assert writes == [[1, 2, 3], [4]] and not process.is_alive()

    driver, process = start()
    driver.send(("open", (), True))  # its answer never read
    driver.send(("log_round", (5, 0), False))
    time.sleep(0.5)  # received and held (the next write is due in 2 s)
    driver.close()
    process.join(10)
    assert writes[-1] == [5] and not process.is_alive()


def test_the_tracking_process_writes_rounds_without_being_asked(tracking_uri):
    """Rounds sent and not followed by any call that waits are still written, within
    ``ROUNDS_EVERY_S``: the MLflow UI follows a long run as it goes."""
    import time

    from cluster.runtime.records import RoundRecord
    from cluster.tracking.process import TrackingRun
    from cluster.tracking.service import ROUNDS_EVERY_S

    run = TrackingRun.open(tracking_uri, "test-live", "r", {}, {})
    run_id = run._open_reply()[0]
    run.log_round(RoundRecord(round=1, cohort_size=5, seconds=0.1, metrics={"m": 1.0}))
    client = MlflowClient(tracking_uri)
    deadline = time.monotonic() + ROUNDS_EVERY_S + 10
    while not client.get_metric_history(run_id, "m") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [m.step for m in client.get_metric_history(run_id, "m")] == [1]
    run.end()


def test_a_prestarted_process_opens_an_existing_store_and_never_creates_one(tmp_path, monkeypatch):
    """Started ahead of its run, the tracking process opens the store it will write to (MLflow
    keeps the engine): an existing SQLite store, never a new one, since the run may not track."""
    from cluster.tracking.service import _preload

    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    _preload()
    assert not db.exists()
    MlflowClient(f"sqlite:///{db}").search_experiments()
    # What the preload counts on: MLflow keeps one store per URI for every later client.
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    stores = _tracking_store_registry._get_store_with_resolved_uri
    stores.cache_clear()
    _preload()
    assert stores.cache_info().currsize == 1
    MlflowClient(f"sqlite:///{db}").search_experiments()  # the run's own client
    assert stores.cache_info().hits >= 1 and stores.cache_info().currsize == 1


def test_the_driver_never_imports_mlflow(store_root, tracking_uri):
    """MLflow lives in the tracking process: on a thread of the driver its imports held the GIL
    that the training hosts need (workload A's first round: 1.8 s instead of 0.2 s). The CLI
    starts that process before its own imports; the run takes it, and one left unused exits
    with the driver."""
    import time
    from pathlib import Path

    script = f"""
import sys
import cluster.tracking.process as tracking_process
tracking_process.prestart()
prestarted = tracking_process._prestarted[0][0]
from helpers import small_config
from cluster.runtime.experiment import run_experiment
config = small_config({str(store_root)!r}, "rounds=2", "tracking.enabled=true",
                      "tracking.experiment=test-no-mlflow")
outcome = run_experiment(config)
tracking_process.prestart()  # a spare no run takes
spare = tracking_process._prestarted[0][0]
print(outcome.run_id, "mlflow" in sys.modules, prestarted.returncode, spare.pid)
"""
    done = run_python(script)
    assert done.returncode == 0, done.stderr[-3000:]
    run_id, imported, prestarted_code, spare = done.stdout.split()[-4:]
    assert imported == "False"
    assert prestarted_code == "0"  # the run's process: it ended with the run
    stat = Path(f"/proc/{spare}/stat")
    for _ in range(100):  # the spare reads EOF once the driver is gone, and exits
        if not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the unused tracking process {spare} outlived the driver")
    client = MlflowClient(tracking_uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert "partition" in {a.path for a in client.list_artifacts(run_id)}


def test_runs_one_after_another_each_find_a_tracking_process_loaded_during_the_last(monkeypatch):
    """``compare``'s runs in process: each tracked run takes a prestarted process, and the next
    tracked run's is started as this one begins (it loads MLflow while this one trains); an
    untracked run gets none, and none is left over after the last run."""
    from types import SimpleNamespace

    import cluster.runtime.experiment
    import cluster.tracking.process as tracking_process
    from cluster.analysis.trials import run_in_process

    class Process:  # a stand-in for the tracking process, alive until told
        def __init__(self):
            self.code = None

        def poll(self):
            return self.code

    spawned, seen = [], []

    def spawn(preload):
        spawned.append((Process(), SimpleNamespace(close=lambda: None), preload))
        return spawned[-1][:2]

    def run_experiment(config, **kwargs):
        seen.append(len(tracking_process._prestarted))
        if config.tracking.enabled:  # as TrackingRun does
            assert tracking_process._take_prestarted() is not None
        return SimpleNamespace(interrupted=False)

    monkeypatch.setattr(tracking_process, "_spawn", spawn)
    monkeypatch.setattr(tracking_process, "_prestarted", [])
    monkeypatch.setattr(cluster.runtime.experiment, "run_experiment", run_experiment)

    def trial(name, tracked):
        return SimpleNamespace(
            name=name, config=SimpleNamespace(tracking=SimpleNamespace(enabled=tracked))
        )

    trials = [trial("a", True), trial("b", True), trial("c", True), trial("d", False)]
    spawned_before = []
    run_in_process(trials, None, lambda result: spawned_before.append(len(spawned)))
    assert seen == [2, 2, 1, 0]  # each tracked run finds its own and the next run's
    assert spawned_before == [2, 3, 3, 3] and all(preload for *_, preload in spawned)
    assert tracking_process._prestarted == []

    # A spare that exited meanwhile is replaced, and its connection closed.
    closed = []
    tracking_process.prestart()
    dead = tracking_process._prestarted[0]
    dead[0].code = 1
    monkeypatch.setattr(dead[1], "close", lambda: closed.append(True))
    tracking_process.prestart()
    assert closed == [True] and tracking_process._prestarted[0] is not dead


def test_update_norm_plots_leave_out_clients_that_released_nothing(tmp_path):
    """DP-SCAFFOLD-warm's warm-up rounds release no update (NaN norms): the plot leaves them
    out, with no warning on the terminal (matplotlib's All-NaN), and draws the trained rounds."""
    import warnings
    from types import SimpleNamespace

    import numpy as np

    from cluster.tracking.tracker import _plot_update_norms, _update_norms

    norms = [np.full(3, np.nan)] * 4 + [np.array([0.5, np.nan, 2.0]), np.array([1.0, 3.0, 0.2])]
    history = [
        SimpleNamespace(round=i + 1, update_norms=n.astype(np.float32).tobytes(), metrics={})
        for i, n in enumerate(norms)
    ]
    offsets, flat = _update_norms(history)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plot_update_norms(history, offsets, flat, 1.0, tmp_path / "norms.png")
        _plot_update_norms(history[:4], offsets[:5], flat[:12], 1.0, tmp_path / "none.png")
    assert (tmp_path / "norms.png").stat().st_size > 0 and not (tmp_path / "none.png").exists()
