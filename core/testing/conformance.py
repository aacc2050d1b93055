"""The back-end conformance kit: an executable definition of "a correct accelerator plugin".

A pytest plugin, shipped in the wheel and not auto-registered. Run it as

    deepinfer conformance NAME [--conformance-report PATH] [pytest args...]
    pytest -p deepinfer.testing.conformance --accelerator=NAME [--conformance-report PATH]

The CPU back end is the oracle. Levels (the `level` marker of each test):
0 contract, 1 op numerics, 2 sampler, 3 memory, 4 collectives, 5 end to end.
Tests of capabilities the back end does not declare are skipped and listed in the report.
The tests themselves live in `deepinfer.testing.conformance_tests`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TESTS_FILE = Path(__file__).with_name("conformance_tests.py")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("deepinfer conformance")
    group.addoption("--accelerator", action="store", default=None, help="accelerator plugin name to check")
    group.addoption("--conformance-report", action="store", default=None,
                    help="write a JSON pass/skip/fail matrix to this path")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "level(n): conformance level (0 contract .. 5 end to end)")
    config.addinivalue_line("markers", "capability(name): needs this Capabilities field to be truthy")
    if config.getoption("accelerator") and not _explicit_paths(config):
        config.args[:] = [str(TESTS_FILE)]  # `pytest -p ... --accelerator X` runs the kit itself
    config._conformance_results = {}


def _explicit_paths(config) -> bool:
    return any(Path(a.split("::")[0]).resolve() == TESTS_FILE.resolve() for a in config.args)


@pytest.fixture(scope="session")
def accelerator_name(request) -> str:
    name = request.config.getoption("accelerator")
    if not name:
        pytest.exit("the conformance kit needs --accelerator=NAME", returncode=4)
    return name


@pytest.fixture(scope="session")
def accelerator_class(accelerator_name):
    from deepinfer.plugins import load_accelerator_class
    return load_accelerator_class(accelerator_name)


@pytest.fixture(scope="session")
def acc(accelerator_class):
    result = accelerator_class.probe()
    if not result.usable:
        pytest.exit(f"accelerator '{accelerator_class.name}' is not usable here: {result.reason}", returncode=4)
    return accelerator_class()


@pytest.fixture(scope="session")
def ref():
    from deepinfer.plugins import load_accelerator_class
    return load_accelerator_class("cpu")()


@pytest.fixture(autouse=True)
def _capability_gate(request):
    marker = request.node.get_closest_marker("capability")
    if marker is None:
        return
    acc_ = request.getfixturevalue("acc")
    caps = acc_.capabilities()
    for cap in marker.args:
        if not getattr(caps, cap, False):
            pytest.skip(f"capability '{cap}' not declared by {caps.name}")


def pytest_runtest_logreport(report) -> None:
    config = getattr(pytest_runtest_logreport, "_config", None)
    if config is None:
        return
    results = config._conformance_results
    entry = results.setdefault(report.nodeid.split("::", 1)[-1], {"outcome": "passed", "level": None, "reason": ""})
    entry["level"] = getattr(report, "conformance_level", entry["level"])
    if report.skipped:
        entry["outcome"] = "skipped"
        entry["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
    elif report.failed:
        entry["outcome"] = "failed"
        entry["reason"] = str(report.longreprtext).strip().splitlines()[-1] if report.longreprtext else ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    marker = item.get_closest_marker("level")
    outcome.get_result().conformance_level = marker.args[0] if marker else None


def pytest_sessionstart(session) -> None:
    pytest_runtest_logreport._config = session.config


def pytest_sessionfinish(session, exitstatus) -> None:
    config = session.config
    results = config._conformance_results
    path = config.getoption("conformance_report")
    if path:
        summary = {k: sum(1 for r in results.values() if r["outcome"] == k) for k in ("passed", "skipped", "failed")}
        Path(path).write_text(json.dumps({"accelerator": config.getoption("accelerator"), "summary": summary,
                                          "tests": results}, indent=2, sort_keys=True))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    skipped = {k: r["reason"] for k, r in getattr(config, "_conformance_results", {}).items() if r["outcome"] == "skipped"}
    if skipped:
        terminalreporter.write_sep("-", "conformance: skipped (capability not declared or not applicable)")
        for name, reason in sorted(skipped.items()):
            terminalreporter.write_line(f"{name}: {reason}")


def main(argv: list[str] | None = None) -> int:
    """`deepinfer conformance NAME [--conformance-report PATH] [pytest args]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: deepinfer conformance NAME [--conformance-report PATH] [pytest options]", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    return int(pytest.main([str(TESTS_FILE), f"--accelerator={name}", "-q", "-p", "no:cacheprovider", *rest],
                           plugins=[sys.modules[__name__]]))
