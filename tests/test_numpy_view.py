"""``datasets.store.numpy_view`` is pyarrow's zero-copy ``to_numpy`` for a store's columns, and
a host reading its clients' rows never imports pandas (pyarrow's ``to_numpy`` does: 0.5 s of CPU
in every actor's start)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from datasets.store import numpy_view

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "dtype", [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64]
)
@pytest.mark.parametrize(("start", "stop"), [(0, 20), (3, 17)])  # whole, and an offset slice
def test_numpy_view_is_pyarrows_zero_copy_to_numpy(dtype, start, stop):
    array = pa.array(np.arange(20).astype(dtype))[start:stop]
    view, theirs = numpy_view(array), array.to_numpy(zero_copy_only=True)
    assert view.dtype == theirs.dtype and np.array_equal(view, theirs)
    assert view.ctypes.data == theirs.ctypes.data  # the same memory: no copy
    assert not view.flags.writeable


@pytest.mark.parametrize(
    "array", [pa.array([1, None, 3]), pa.array([True, False]), pa.array(["a", "b"])]
)
def test_numpy_view_refuses_what_a_store_never_holds(array):
    with pytest.raises(ValueError, match="null-free integers or floats"):
        numpy_view(array)


READ_A_CLIENT = """
import sys
from datasets.store import ShardStore
rows = ShardStore.open(sys.argv[1]).client(3)  # what a host reads of its clients
print(len(rows.y), "pandas" in sys.modules)
"""


def test_reading_a_client_from_a_store_imports_no_pandas(tmp_path):
    from cluster.config import load_config
    from cluster.runtime.store import open_store

    store, _ = open_store(load_config(None, ["data.num_clients=20", f"data.store_root={tmp_path}"]))
    done = subprocess.run(
        [sys.executable, "-c", READ_A_CLIENT, str(store.location)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows, pandas = done.stdout.split()
    assert int(rows) > 0 and pandas == "False"
