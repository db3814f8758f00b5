"""actors.client_state: rows only for clients with state, checkpoint round trip, and nothing left
on disk: no file for a store without state, no path even while a store is alive or after its
process is SIGKILLed (as Ray kills actors)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.client_state import ClientStateStore

REPO = Path(__file__).resolve().parents[1]

# Fills a store in $DPFL_STATE_DIR, reports its allocated bytes, then waits to be killed.
_FILL_AND_WAIT = """
import time, torch
from actors.client_state import ClientStateStore
store = ClientStateStore()
for client_id in range(40):
    store.put(client_id, {"control": torch.ones(1000)})
print(store.allocated_bytes, flush=True)
time.sleep(600)
"""


def test_client_state_store_allocates_rows_only_for_clients_with_state(tmp_path):
    store = ClientStateStore(directory=str(tmp_path))
    generator = torch.Generator().manual_seed(0)
    values = {cid: torch.randn(1000, generator=generator) for cid in (7, 3, 500_000)}
    for cid, value in values.items():
        store.put(cid, {"control": value})
    store.put(11, {})  # a stateless client costs nothing
    assert len(store) == 3 and 11 not in store and store.get(11) == {}
    for cid, value in values.items():
        assert torch.equal(store.get(cid)["control"], value)
    # The file holds the allocated rows (capacity ≥ 16), not one per hosted client id.
    assert store.allocated_bytes == 16 * 1000 * 4
    state = store.state_dict()
    assert state["client_ids"].tolist() == [3, 7, 500_000]
    copy = ClientStateStore(directory=str(tmp_path))
    copy.load_state_dict(state)
    assert all(torch.equal(copy.get(c)["control"], v) for c, v in values.items())
    keep = np.zeros(500_001, dtype=bool)
    keep[[3, 500_000]] = True
    half = ClientStateStore.select(state, keep)
    merged = ClientStateStore.merge([half, ClientStateStore.select(state, ~keep)])
    assert sorted(merged["client_ids"].tolist()) == [3, 7, 500_000]
    assert not any(tmp_path.iterdir())  # the files have no path


def test_a_store_grows_past_its_first_capacity_keeping_every_row(tmp_path):
    store = ClientStateStore(directory=str(tmp_path))
    values = {cid: torch.full((5,), float(cid)) for cid in range(40)}  # 16 → 32 → 64 rows
    for cid, value in values.items():
        store.put(cid, {"control": value})
    assert store.allocated_bytes == 64 * 5 * 4
    assert all(torch.equal(store.get(c)["control"], v) for c, v in values.items())


def test_a_store_without_state_opens_no_file(tmp_path):
    store = ClientStateStore(directory=str(tmp_path))
    for client_id in range(10):
        store.put(client_id, {})  # what a stateless algorithm's clients upload
        assert store.get(client_id) == {}
    assert store.allocated_bytes == 0 and len(store) == 0
    assert store.state_dict()["client_ids"].tolist() == []
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads a process's open files")
def test_a_sigkilled_store_leaves_nothing_in_its_directory(tmp_path):
    env = {**os.environ, "DPFL_STATE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-c", _FILL_AND_WAIT], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert int(process.stdout.readline()) == 64 * 1000 * 4
        fd_dir = Path(f"/proc/{process.pid}/fd")
        open_files = [os.readlink(fd) for fd in fd_dir.iterdir()]
        # The rows live in $DPFL_STATE_DIR, in a file that has no name there.
        assert any(target.startswith(f"{tmp_path}/") for target in open_files)
        assert not any(tmp_path.iterdir())
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not any(tmp_path.iterdir())


def test_a_state_directory_that_cannot_be_written_is_refused_when_the_host_starts(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=r"DPFL_STATE_DIR = .*missing.*not a writable directory"):
        ClientStateStore(directory=str(missing))


def test_a_put_that_fails_leaves_the_client_without_state(tmp_path):
    root = tmp_path / "states"
    root.mkdir()
    store = ClientStateStore(directory=str(root))
    root.rmdir()  # the directory vanishes after the host started: the first put cannot open
    with pytest.raises(FileNotFoundError):
        store.put(7, {"control": torch.ones(3)})
    assert 7 not in store and len(store) == 0 and store.get(7) == {}
    assert store.state_dict()["client_ids"].tolist() == []
