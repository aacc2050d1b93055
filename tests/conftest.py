"""Shared fixtures. Tests never touch the network; tiny checkpoints are built in tmp folders."""
from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    """Make an installed-looking distribution (dist-info + module) visible on sys.path.

    This is exactly what pip leaves behind, so importlib.metadata discovers its entry points."""
    created = []

    def make(dist: str, version: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]):
        root = tmp_path / f"site-{dist}"
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = []
        for group, eps in entry_points.items():
            lines.append(f"[{group}]")
            lines += [f"{k} = {v}" for k, v in eps.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for mod, code in modules.items():
            (root / f"{mod}.py").write_text(textwrap.dedent(code))
            created.append(mod)
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        return root

    yield make
    for mod in created:
        sys.modules.pop(mod, None)


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny ops gain nothing from two threads on two busy cores, and
    can be several times slower with them."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: Variables that choose the CPU tier the whole suite runs on (the suite is run once per tier, e.g.
#: `DEEPINFER_CPU_NATIVE_ISA=no-avx512`): clean_env keeps them, so that a rank process a test spawns
#: builds the same kernels as the test process it is compared with.
SUITE_TIER_VARIABLES = {"DEEPINFER_CPU_NATIVE", "DEEPINFER_CPU_NATIVE_ISA"}


@pytest.fixture
def clean_env(monkeypatch):
    """No DEEPINFER_* variable from the outer environment leaks into a test (but the suite's tier)."""
    import os
    for key in list(os.environ):
        if key.startswith("DEEPINFER_") and key not in SUITE_TIER_VARIABLES:
            monkeypatch.delenv(key)
    return monkeypatch


@pytest.fixture(autouse=True)
def _restore_deepinfer_env():
    """Code under test (e.g. the example applying the seeds' defaults) may set DEEPINFER_*
    variables; none of them leaks into the next test."""
    import os
    saved = {k: v for k, v in os.environ.items() if k.startswith("DEEPINFER_")}
    yield
    for key in [k for k in os.environ if k.startswith("DEEPINFER_")]:
        if key not in saved:
            del os.environ[key]
    os.environ.update(saved)


@pytest.fixture
def no_hang():
    """Fail the test with TimeoutError when its body blocks for 60 s, instead of hanging the suite
    (e.g. opening a FIFO for reading waits forever for a writer). Main thread only (SIGALRM)."""
    import signal

    def expire(signum, frame):
        raise TimeoutError("blocked for 60 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)
