"""For every test directory: tests/ (shared helpers such as ``_spawn`` and ``_vcluster``) and
the repo's tools/ (``import vcluster``) on ``sys.path``, and a skip-if-unavailable fixture for
tests that build virtual clusters."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratagem.elastic import JobContext, job_context

TESTS = Path(__file__).resolve().parent
for path in (TESTS, TESTS.parent / "tools"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import _load  # noqa: E402
import vcluster  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_job_context() -> Iterator[JobContext]:
    """Every test runs in a job context of its own (no states, no SIGTERM request, no
    rescale group), dropped when it ends; ``drop_job()`` inside a test models a restart."""
    with job_context() as ctx:
        yield ctx


@pytest.fixture
def need_vcluster() -> None:
    """Skip, with the reason, where this machine cannot build a virtual cluster."""
    ok, reason = vcluster.VirtualCluster.available()
    if not ok:
        pytest.skip(f"virtual cluster unavailable: {reason}")


SHARED_HOST = "shared-host"
"""The xdist group of tests that take host-wide things (network namespaces, bridges and
routes of a virtual cluster; a local Ray cluster): under ``pytest -n 2 --dist loadgroup``
they run one after another on one worker, while the other worker runs the rest."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in an xdist group: :data:`SHARED_HOST`, or its module's (so that a
    module's fixtures, some of them whole multi-process runs, are set up once, not once
    per worker). First among the hooks: xdist's own, which reads the groups into the
    test ids that ``--dist loadgroup`` schedules by, runs after it (without ``tryfirst``
    it ran before, and no group held: two Ray clusters, two virtual clusters at once)."""
    for item in items:
        path = Path(str(item.fspath))
        shared = ("need_vcluster" in getattr(item, "fixturenames", ())
                  or item.get_closest_marker("vcluster") is not None
                  or "vcluster" in path.name or path.parent.name == "service")
        group = SHARED_HOST if shared else str(path.relative_to(TESTS))
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On an xdist worker under ``--dist loadgroup``: fail a grouped test whose group did not
    reach the test id xdist schedules by. pytest 9.2 moved ``nodeid`` off the attribute
    that xdist 3.8 rewrites, and every group silently stopped holding (Ray and virtual-
    cluster tests then ran two at a time and failed under load); pyproject pins below it."""
    if (getattr(item.config.option, "loadgroup", False)
            and item.get_closest_marker("xdist_group") and "@" not in item.nodeid):
        pytest.fail(f"--dist loadgroup: this test lost its xdist group: this pytest "
                    f"({pytest.__version__}) and pytest-xdist do not work together; install "
                    "the versions pyproject.toml's dev extra allows", pytrace=False)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test's pytest-timeout stretched by the same load factor as its waits
    (:mod:`_load`), sampled once as it starts: on a loaded machine a test's own deadline,
    not a fixed 300 s, ends a slow wait, and a hung test still ends (at most
    ``MAX_FACTOR`` times its timeout). Runs before pytest-timeout reads the marker."""
    _load.stretch_timeout(item, _load.begin_test())
    try:
        return (yield)
    finally:
        _load.end_test()
