"""The test suite's own guards and helpers: no test writes into the source tree, the shared tiny
checkpoints stay as built, and the compile-once compiler reuses only builds that are the same."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SOURCE_TREE_GUARD, _shared_checkpoint
from source_tree_guard import SourceTreeGuard

PROBE = REPO / "core" / "models" / "_guard_probe.py"  # never exists


# ----------------------------------------------------------------------------- source tree

def _outside_file(tmp_path: Path) -> Path:
    path = tmp_path / "outside.py"
    path.write_text("x = 1\n")
    return path


WRITES = {
    "open for writing": lambda tmp: PROBE.write_text("x = 1\n"),
    "os.open creating": lambda tmp: os.close(os.open(PROBE, os.O_WRONLY | os.O_CREAT, 0o644)),
    "copy into": lambda tmp: shutil.copy(_outside_file(tmp), PROBE),
    "rename into": lambda tmp: os.replace(_outside_file(tmp), PROBE),
    "mkdir": lambda tmp: PROBE.mkdir(),
    "symlink": lambda tmp: PROBE.symlink_to(_outside_file(tmp)),
    # on a name that does not exist: unguarded, these would fail with FileNotFoundError instead
    "remove": lambda tmp: os.remove(PROBE),
    "chmod": lambda tmp: os.chmod(PROBE, 0o600),
}


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_a_write_into_the_source_tree_is_refused_and_recorded(write, tmp_path):
    before = len(SOURCE_TREE_GUARD.attempts)
    try:
        with pytest.raises(PermissionError, match="tests must not write into the source tree: .*_guard_probe.py"):
            write(tmp_path)
        assert not PROBE.exists() and not PROBE.is_symlink()
        assert SOURCE_TREE_GUARD.attempts[before:] == [str(PROBE)]  # what fails the test at its teardown
    finally:
        del SOURCE_TREE_GUARD.attempts[before:]  # this test tried on purpose


def test_what_the_guard_lets_through_and_what_it_refuses(tmp_path):
    guard = SourceTreeGuard(tmp_path)
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    guard("open", (str(tmp_path / "core" / "engine.py"), "r", os.O_RDONLY))
    guard("open", (str(tmp_path / "core" / "__pycache__" / "engine.cpython-311.pyc"), "wb", write))
    guard("os.mkdir", (str(tmp_path / "plugins" / "__pycache__"), 0o777, -1))
    guard("open", (str(tmp_path / ".pytest_cache" / "v" / "lastfailed"), "w", write))  # pytest's own state
    guard("open", (str(tmp_path / ".venv" / "lib" / "x.pth"), "w", write))  # the environment
    guard("open", (str(tmp_path.parent / "elsewhere.py"), "w", write))  # outside the checkout
    guard("open", (3, "w", write))  # a descriptor opened earlier
    guard("os.rename", ("x.tmp", "core.py", 5, 5))  # relative to directory descriptors
    guard.allow(tmp_path / "tests" / "baseline.json")  # what a command-line option asked the run to write
    guard("open", (str(tmp_path / "tests" / "baseline.json"), "w", write))
    guard("open", (str(tmp_path / "tests" / "baseline.json.lock"), "w", write))  # and the files named after it
    (tmp_path / "core").mkdir()
    guard("os.mkdir", (str(tmp_path / "core"), 0o777, -1))  # an existing folder: mkdir(exist_ok=True) changes nothing
    assert guard.attempts == []
    for event, args in [("open", (str(tmp_path / "docs" / "new.md"), "w", write)),
                        ("os.rename", (str(tmp_path.parent / "x"), str(tmp_path / "examples" / "x.py"), -1, -1)),
                        ("os.remove", (str(tmp_path / "tests" / "test_x.py"), -1)),
                        ("open", (str(tmp_path / "README.md"), "a", os.O_WRONLY | os.O_APPEND)),  # a top-level file
                        ("os.mkdir", (str(tmp_path / ".venv-not"), 0o777, -1)),  # a new top-level folder
                        ("open", (str(tmp_path / "tests" / "baseline.jsonl"), "w", write))]:  # not the allowed one
        with pytest.raises(PermissionError):
            guard(event, args)
    assert [Path(p).name for p in guard.attempts] == ["new.md", "x.py", "test_x.py", "README.md", ".venv-not",
                                                     "baseline.jsonl"]


# ----------------------------------------------------------------------------- shared checkpoints

def test_a_changed_shared_checkpoint_is_reported_at_the_end_of_the_session(tmp_path_factory):
    def make_model(out: Path, size: str, seed: int) -> Path:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    session = _shared_checkpoint(tmp_path_factory, "probe", make_model)
    path = next(session)
    (path / "config.json").write_text('{"edited": true}')
    with pytest.raises(AssertionError, match="a test changed the shared probe checkpoint"):
        next(session)


# ----------------------------------------------------------------------------- compile once

CC = os.environ.get("CC") or "cc"


@pytest.fixture
def c_project(tmp_path) -> Path:
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which(CC.split()[0]) is None:
        pytest.skip("needs a C compiler for x86-64")
    (tmp_path / "k.h").write_text("#define K 1\n")
    (tmp_path / "k.c").write_text('#include "k.h"\nint k(void) { return K; }\n')
    (tmp_path / "memo").mkdir()
    return tmp_path


def compile_once(project: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tests" / "compile_once.py"), str(project / "memo"), CC,
                           *map(str, args)], capture_output=True, text=True, timeout=120)


def test_compile_once_reuses_a_build_only_where_the_code_is_the_same(c_project):
    def build(name: str, *flags: str) -> bytes:
        out = compile_once(c_project, "-O2", "-fPIC", "-shared", "-march=x86-64-v3", *flags, "-o", c_project / name,
                           c_project / "k.c")
        assert out.returncode == 0, out.stderr
        return (c_project / name).read_bytes()

    first = build("a.so")
    [kept] = (c_project / "memo").iterdir()
    assert kept.read_bytes() == first
    kept.write_bytes(b"kept")  # a copy of it, not a new compilation, tells the reuse apart
    # x86-64-v3 has no AVX-512: masking it off defines the same macros, so it is the same build
    assert build("b.so", "-mno-avx512f") == b"kept"
    # another level, another flag, another header: each compiled
    assert build("c.so", "-march=x86-64-v2") != b"kept"
    assert build("d.so", "-O1") != b"kept"
    (c_project / "k.h").write_text("#define K 2\n")
    assert build("e.so") != b"kept"
    assert len(list((c_project / "memo").iterdir())) == 4


def test_compile_once_passes_failures_and_other_calls_through(c_project):
    (c_project / "bad.c").write_text("int broken(void) { return }\n")
    failed = compile_once(c_project, "-shared", "-o", c_project / "bad.so", c_project / "bad.c")
    assert failed.returncode != 0 and "error" in failed.stderr
    assert not (c_project / "bad.so").exists() and not list((c_project / "memo").iterdir())  # nothing kept
    version = compile_once(c_project, "--version")
    assert version.returncode == 0 and version.stdout.strip()
