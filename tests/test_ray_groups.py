"""Every test module that starts Ray runs in the serial xdist group (``RAY_MODULES`` in
``tests/conftest.py``): two Rays at once on the 2-core CI machine would each wait on the other's
process starts, and some of these tests bound how long a start or a recovery may take. The
pattern sees a Ray named in a test module; a module whose runs start Ray through a config's
default executor (``kind: ray``) without naming it is not seen, and is listed by hand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import RAY_MODULES

TESTS = Path(__file__).resolve().parent
# What a module that starts Ray contains: a Ray executor in a config or on the command line,
# a cluster or head fixture, the executor itself, or ray.init.
STARTS_RAY = re.compile(
    r"executor\.kind=ray|\"kind\": \"ray\"|kind: ray|\"--executor\", \"ray\"|ray_cluster"
    r"|running_ray|RayExecutor\(|ray\.init\("
)
# They name a Ray executor without starting one: configs refused before any work, configs only
# checked, manifests.
NAMES_RAY_ONLY = {
    "test_bad_input",
    "test_k8s",
    "test_k8s_network",
    "test_k8s_object_storage",
    "test_k8s_security",
    "test_memory_checks",
    "test_ray_groups",
}


def test_every_module_that_starts_ray_is_in_the_serial_group():
    starting = {
        path.stem
        for path in TESTS.glob("test_*.py")
        if STARTS_RAY.search(path.read_text()) and path.stem not in NAMES_RAY_ONLY
    }
    assert starting, "the pattern finds no module: it no longer says how Ray is started"
    assert sorted(starting - RAY_MODULES) == []


def test_the_serial_group_names_existing_modules():
    assert sorted(name for name in RAY_MODULES if not (TESTS / f"{name}.py").exists()) == []


@pytest.mark.xdist_group("probe")
def test_an_xdist_group_keeps_its_tests_on_one_worker(request):
    """pytest-xdist's ``loadgroup`` sends a group to one worker by renaming its tests
    ``…@group`` as the worker collects them. The renaming was lost twice, each time silently
    spreading the serial Ray group over both workers: under pytest 9.2 (pytest-xdist #1386;
    hence pytest < 9.2 in pyproject.toml), and while conftest's hook marked the Ray modules
    after xdist's had renamed the tests (now ``tryfirst``). Both show here: this test's own
    name, and every collected test of a Ray module."""
    if getattr(request.config, "workerinput", None) is None:
        pytest.skip("not on a pytest-xdist worker (-n 0)")
    if not request.config.option.loadgroup:  # a worker's own "dist" is "no"
        pytest.skip("not --dist loadgroup: no groups")
    assert request.node.nodeid.endswith("@probe"), request.node.nodeid
    ray_tests = [
        i for i in request.session.items if i.module.__name__.rsplit(".", 1)[-1] in RAY_MODULES
    ]
    assert [i.nodeid for i in ray_tests if not i.nodeid.endswith("@ray")] == []
