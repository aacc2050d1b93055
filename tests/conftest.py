"""Shared fixtures. Tests never touch the network; tiny checkpoints are built in tmp folders.

`tiny_v4` and `tiny_v41` are the one tiny checkpoint of each model family, built once per session:
a module that needs other sizes or options builds its own variant (e.g. `with_dspark=True`)."""
from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from source_tree_guard import SourceTreeGuard

REPO = Path(__file__).resolve().parents[1]

#: refuses and records every write into the source tree (tests/source_tree_guard.py); audit hooks
#: cannot be removed, so it watches the whole process from here on
SOURCE_TREE_GUARD = SourceTreeGuard(REPO)
sys.addaudithook(SOURCE_TREE_GUARD)

#: The seed of the shared tiny checkpoints (tests that regenerate their tensors use it too).
TINY_SEED = 0


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(folder)): (f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(folder.rglob("*")) if f.is_file()}


def _shared_checkpoint(tmp_path_factory, name: str, make_model, **options):
    """Build a checkpoint once for the session; at the end, fail if any test changed it (a test
    that edits a checkpoint works on a copy: shutil.copytree)."""
    path = make_model(tmp_path_factory.mktemp(name) / "tiny", "tiny", seed=TINY_SEED, **options)
    before = _snapshot(path)
    yield path
    assert _snapshot(path) == before, (f"a test changed the shared {name} checkpoint {path}: "
                                       "copy it (shutil.copytree) before editing it")


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory) -> Path:
    """The tiny random-weight DeepSeek-V4 checkpoint (transformers format, fp32, MTP block, seed
    TINY_SEED), shared by the whole session: read it, never write into it."""
    from deepinfer.models.deepseek_v4.make_model import make_model

    yield from _shared_checkpoint(tmp_path_factory, "tiny_v4", make_model)


@pytest.fixture(scope="session")
def tiny_v4_real_vocab(tmp_path_factory) -> Path:
    """`tiny_v4` with the real tokenizer's whole 129,280-token vocabulary and a 32k context, for tests
    whose grammars or prompts use tokens beyond the tiny vocabulary (structured outputs)."""
    from deepinfer.models.deepseek_v4.make_model import make_model

    yield from _shared_checkpoint(tmp_path_factory, "tiny_v4_real_vocab", make_model, vocab_size=129280,
                                  max_position_embeddings=32768)


@pytest.fixture(scope="session")
def tiny_v41(tmp_path_factory) -> Path:
    """The tiny random-weight DeepSeek-V4.1 checkpoint (release format, no DSpark head, seed
    TINY_SEED), shared by the whole session: read it, never write into it."""
    from deepinfer.models.deepseek_v41.make_model import make_model

    yield from _shared_checkpoint(tmp_path_factory, "tiny_v41", make_model)


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


@pytest.fixture(autouse=True)
def _no_writes_into_the_source_tree():
    """A test (or fixture) that tried to write into the source tree fails, even where the code under
    test swallowed the PermissionError."""
    before = len(SOURCE_TREE_GUARD.attempts)
    yield
    tried = SOURCE_TREE_GUARD.attempts[before:]
    assert not tried, f"tried to write into the source tree (refused): {tried}; write into tmp_path instead"


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


@pytest.fixture(scope="session")
def once_compiler(tmp_path_factory) -> list[str]:
    """A C compiler command that compiles each distinct build of the cpu kernels once per session
    (tests/compile_once.py), for tests that build them into temporary folders: the suite's compiler
    ($CC, else cc) underneath."""
    import os

    memo = tmp_path_factory.mktemp("compile_once")
    return [sys.executable, str(Path(__file__).with_name("compile_once.py")), str(memo),
            os.environ.get("CC") or "cc"]


@pytest.fixture
def compile_once(once_compiler, monkeypatch) -> list[str]:
    """$CC is `once_compiler` for this test (the cpu back end's build reads $CC)."""
    import shlex

    monkeypatch.setenv("CC", shlex.join(once_compiler))
    return once_compiler


@pytest.fixture
def prepared_runs(monkeypatch) -> list:
    """Every run of a cpu back end's prepared program (plugins/cpu/program.py: the object, once per step it ran)."""
    from deepinfer_plugins.cpu import program

    runs, run = [], program.PreparedProgram.run

    def counted(self, *args, **kwargs):
        runs.append(self)
        return run(self, *args, **kwargs)
    monkeypatch.setattr(program.PreparedProgram, "run", counted)
    return runs
