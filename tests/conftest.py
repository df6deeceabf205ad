"""Shared fixtures: the SSH testbed (real sshd nodes with simulated GPU/IB tools).

* ``testbed`` (one per test run): a running :class:`testbed.Cluster` of a few mixed nodes
  (see ``TESTBED_SPECS``). Shared by every test of the run: do not inject faults
  into it; start your own with ``testbed_factory``.
* ``testbed_inventory`` (one per test run): the path of its ``inventory.yaml``.
* ``testbed_factory``: ``testbed_factory(specs, **kwargs) -> Cluster`` starts a custom
  cluster (``Cluster.start`` arguments) in a fresh folder; all are stopped after the test.

Tests that use these fixtures get the ``testbed`` marker (``-m "not testbed"`` skips them)
and are skipped with the reason when no testbed can run here (no OpenSSH server). Root
gets network namespaces; other users get the loopback fallback. Override the mode with
``CLUSTERCTL_TESTBED_MODE=netns|loopback``.

Every test marked ``testbed`` (by these fixtures or by hand) or ``llama`` (a real
llama-server) also gets ``e2e``, which ``make test-fast`` leaves out, as it does ``slow``
(real timeouts, subprocesses) and ``hypothesis`` (property tests, hundreds of examples each).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # `pytest` without `python -m`: make the testbed package importable
    sys.path.insert(0, str(_ROOT))

from hypothesis import HealthCheck, settings  # noqa: E402

from testbed import Cluster, NodeSpec, unavailable_reason  # noqa: E402

# sshd starts a node's shell with the default signal dispositions; a suite started under
# nohup would hand its shells an ignored SIGHUP, which no trap of theirs can undo.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

# Wall-clock deadlines make property tests flaky on a busy 2-core CI box; speed is measured by
# the benchmarks under bench/, never by tests.
settings.register_profile("clusterctl", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "clusterctl"))

TESTBED_SPECS = (
    "gpu-01=hgx-h200x8:fabric=ib-a,"
    "gpu-02=hgx-h200x8:fabric=ib-a,"
    "gpu-03=dgx-h100:fabric=ib-b,"
    "gpu-04=a100-pcie-4x,"
    "cpu-01=cpu-only"
)
TESTBED_FIXTURES = ("testbed", "testbed_inventory", "testbed_factory")

ClusterFactory = Callable[..., Cluster]


def testbed_mode() -> str:
    return os.environ.get("CLUSTERCTL_TESTBED_MODE", "auto")


def _skip_unless_available() -> None:
    why = unavailable_reason(testbed_mode())
    if why:
        pytest.skip(f"SSH testbed unavailable: {why}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(f in getattr(item, "fixturenames", ()) for f in TESTBED_FIXTURES):
            item.add_marker(pytest.mark.testbed)
        if item.get_closest_marker("testbed") or item.get_closest_marker("llama"):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A running mixed cluster shared by the whole test run (read-only use, please)."""
    _skip_unless_available()
    c = Cluster.start(tmp_path_factory.mktemp("testbed"), TESTBED_SPECS, mode=testbed_mode())
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def testbed_inventory(testbed: Cluster) -> Path:
    return testbed.inventory_path


@pytest.fixture
def testbed_factory(tmp_path: Path) -> Iterator[ClusterFactory]:
    """Start custom clusters: ``testbed_factory("n1=l40s-2x:ecc=0,n2=cpu-only")``."""
    _skip_unless_available()
    started: list[Cluster] = []

    def start(specs: str | Sequence[str | NodeSpec], **kwargs: Any) -> Cluster:
        kwargs.setdefault("mode", testbed_mode())
        c = Cluster.start(tmp_path / f"testbed{len(started)}", specs, **kwargs)
        started.append(c)
        return c

    try:
        yield start
    finally:
        for c in started:
            c.stop()
