"""Perplexity baselines (ppl_baseline.py): the `--output` option and the session's baselines."""
from __future__ import annotations

import pytest

from .ppl_baseline import Baselines, output_path


def pytest_addoption(parser):
    parser.addoption("--output", action="store", nargs="?", const="default", default=None, metavar="PATH",
                     help="write a candidate perplexity baseline (tests/models/offline_decode_ppl.json with the "
                          "values measured in this run merged in) to PATH; single node only. Without PATH: update "
                          "the default file, each node only the samples of its own ranks (several nodes)")


def _target(config):
    import os

    from deepinfer.parallel.layout import env_int

    try:
        return output_path(config.getoption("--output", default=None), env_int(os.environ, "WORLD_SIZE", 1, 1))
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_configure(config):
    target = _target(config)  # a refused --output fails before any test runs
    if target is not None:  # asked for: the default file is in the source tree, which tests never write otherwise
        from conftest import SOURCE_TREE_GUARD

        SOURCE_TREE_GUARD.allow(target)


@pytest.fixture(scope="session")
def baselines(request):
    found = Baselines.load()
    yield found
    target = _target(request.config)
    if target is not None and found.measured:
        found.write(target)
        print(f"\nperplexity baseline candidate ({len(found.measured)} cases) written to {target}")


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """build -> checkpoint path, each model made once per session."""
    folder = tmp_path_factory.mktemp("ppl-models")
    made = {}

    def get(build):
        if build not in made:
            made[build] = build.build(folder)
        return made[build]

    return get
