"""The compiled-kernel cache of the cpu back end ($DEEPINFER_CACHE_DIR/cpu_native): who may write it,
how libraries are written, and that nothing is loaded unless it matches the sha256 recorded when
it was built. Refused or unusable caches leave the back end on the pure-torch kernels with one
warning."""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import subprocess

import pytest
import torch

from deepinfer_plugins.cpu import native
from deepinfer_plugins.cpu.kernels import CpuKernels
from deepinfer_plugins.cpu.native_kernels import NativeCpuKernels

REF = CpuKernels()


@pytest.fixture(autouse=True)
def fresh_library(compile_once):
    """library() is cached per process: each test builds or refuses its own, later users rebuild
    (or find) the real one. Each test compiles into a new cache; compile_once compiles only the
    first of the identical builds."""
    native.library.cache_clear()
    yield
    native.library.cache_clear()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(root))
    monkeypatch.delenv("DEEPINFER_CPU_NATIVE", raising=False)
    return root


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "native C kernels" in r.getMessage()]


def assert_refused(caplog, directory, *words, nothing_built=True):
    """library() gave None with one warning that names the directory and the fix, not the compiler,
    and the back end still runs (on the pure-torch kernels)."""
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        assert native.library() is None
        kernels = NativeCpuKernels()
        x = torch.randn(3, 64)
        assert torch.equal(kernels.rms_norm(x, None, 1e-6), REF.rms_norm(x, None, 1e-6))
        assert kernels.native_library is None
    messages = warnings_of(caplog)
    assert len(messages) == 1, messages
    assert str(directory) in messages[0] and "DEEPINFER_CACHE_DIR" in messages[0]
    assert "install a C compiler" not in messages[0]
    for word in words:
        assert word in messages[0], messages[0]
    if nothing_built:
        assert not list(directory.parent.rglob("*.so")), "nothing may be built into a refused directory"


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_new_directory_is_private_and_libraries_carry_their_hash(cache):
    lib = native.library()
    assert lib is not None
    directory = cache / "cpu_native"
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    [built] = directory.glob("kernels-*.so")
    record = directory / (built.name + ".sha256")
    assert record.read_text().strip() == sha256(built)
    assert not stat.S_IMODE(os.stat(built).st_mode) & 0o022
    assert not list(directory.glob("*.tmp"))  # written under temporary names, then renamed


@pytest.mark.slow
def test_umask_does_not_widen_the_new_directory(cache):
    old = os.umask(0o002)  # a user-private-group umask: mkdir alone would give 0775
    try:
        assert native.library() is not None
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(cache / "cpu_native").st_mode) == 0o700
    [built] = (cache / "cpu_native").glob("kernels-*.so")
    assert not stat.S_IMODE(os.stat(built).st_mode) & 0o022


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702], ids=oct)
def test_directory_writable_by_others_is_refused(cache, caplog, mode):
    directory = cache / "cpu_native"
    directory.mkdir(parents=True)
    os.chmod(directory, mode)
    assert_refused(caplog, directory, "chmod 700", f"{mode:04o}")


def test_directory_owned_by_another_user_is_refused(cache, caplog, monkeypatch):
    directory = cache / "cpu_native"
    directory.mkdir(parents=True, mode=0o700)
    if os.geteuid() == 0:
        os.chown(directory, 65534, 65534)  # nobody
        assert_refused(caplog, directory, "not owned by you")
    else:  # cannot give it away: be someone else instead (then DEEPINFER_CACHE_DIR is foreign too)
        me = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: me + 1)
        assert_refused(caplog, cache, "owned by")


def test_symlinked_directory_is_refused(cache, caplog, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    cache.mkdir()
    (cache / "cpu_native").symlink_to(elsewhere)
    assert_refused(caplog, cache / "cpu_native", "symbolic link")


@pytest.mark.slow
def test_root_writable_by_everyone_is_refused_unless_sticky(cache, caplog):
    # whoever can rename entries of DEEPINFER_CACHE_DIR could swap the library directory
    cache.mkdir()
    os.chmod(cache, 0o777)
    assert_refused(caplog, cache, "writable by everyone")
    native.library.cache_clear()
    os.chmod(cache, 0o1777)  # sticky, as /tmp: only the owner may rename cpu_native
    assert native.library() is not None


def test_root_owned_by_another_user_is_refused(cache, caplog):
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    cache.mkdir()
    os.chown(cache, 65534, 65534)
    assert_refused(caplog, cache, "owned by another user")


def test_unwritable_cache_directory_names_the_directory_not_the_compiler(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(blocker / "cache"))
    assert_refused(caplog, blocker / "cache" / "cpu_native", "cannot create or write")


def planted_library(tmp_path):
    """A valid library with every kernel symbol, built from other sources: the kernels plus a marker."""
    marker = tmp_path / "planted.c"
    marker.write_text("int planted_marker(void) { return 42; }\n")
    out = tmp_path / "planted.so"
    subprocess.run([*native._compiler(), *native.FLAGS, "-o", str(out), *map(str, native.SOURCES), str(marker)],
                   check=True, capture_output=True)
    return out


def has_marker(lib) -> bool:
    try:
        lib.planted_marker
    except AttributeError:
        return False
    return True


@pytest.mark.parametrize("record", ["missing", "stale", "garbage"])
@pytest.mark.slow
def test_planted_library_is_rebuilt_not_loaded(cache, tmp_path, caplog, record):
    target = native._build()  # the name this configuration uses (built once, legitimately)
    digest_file = target.with_name(target.name + ".sha256")
    planted = planted_library(tmp_path).read_bytes()
    target.write_bytes(planted)  # same owner, same private mode: only the hash tells it apart
    if record == "missing":
        digest_file.unlink(missing_ok=True)
    elif record == "garbage":
        digest_file.write_text("not a digest")
    # "stale": the record of the legitimate build stays
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        lib = native.library()
    assert lib is not None and not has_marker(lib)
    assert target.read_bytes() != planted and digest_file.read_text().strip() == sha256(target)
    if record == "stale":
        assert any("does not match its recorded sha256" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_planted_library_with_its_own_record_in_a_foreign_directory_is_not_loaded(cache, tmp_path, caplog):
    # a matching record is only worth something in a directory nobody else can write: a library and
    # hash dropped into someone else's directory are never loaded
    target = native._build()
    planted = planted_library(tmp_path)
    target.write_bytes(planted.read_bytes())
    target.with_name(target.name + ".sha256").write_text(sha256(planted) + "\n")
    os.chmod(target.parent, 0o777)
    assert_refused(caplog, target.parent, "writable by others", nothing_built=False)
    assert target.read_bytes() == planted.read_bytes()  # left alone, and not loaded


@pytest.mark.slow
def test_file_that_is_not_a_library_is_rebuilt(cache):
    target = native._build()
    target.write_bytes(b"\x7fELF but not really")
    assert native.library() is not None
    assert target.with_name(target.name + ".sha256").read_text().strip() == sha256(target)


@pytest.mark.slow
def test_symlink_planted_under_the_library_name_is_not_followed(cache, tmp_path):
    target = native._build()
    planted = planted_library(tmp_path)
    target.unlink()
    target.symlink_to(planted)
    target.with_name(target.name + ".sha256").write_text(sha256(planted) + "\n")
    lib = native.library()
    assert lib is not None and not has_marker(lib)
    assert not target.is_symlink()


@pytest.mark.slow
def test_load_refuses_a_library_that_does_not_match_its_record(tmp_path):
    # _load checks the very descriptor it loads: whatever _build saw, a mismatch is never loaded
    path = tmp_path / "kernels-x.so"
    native._compile(path, native._compiler(), native.build_flags())
    assert native._load(path) is not None
    # swapped in by a rename, as an attacker would: overwriting the loaded library's own inode in
    # place would change the code this process has mapped (and crash it at exit)
    swapped = tmp_path / "swapped.so"
    swapped.write_bytes(planted_library(tmp_path).read_bytes())
    os.replace(swapped, path)
    with pytest.raises(native.CacheError, match="refusing to load"):
        native._load(path)
    path.with_name(path.name + ".sha256").unlink()
    with pytest.raises(native.CacheError, match="refusing to load"):
        native._load(path)


def test_a_fifo_under_the_library_or_record_name_is_refused_without_blocking(tmp_path, no_hang):
    # a FIFO opened for reading waits for a writer forever: the cache opens files without blocking
    # and reads regular files only
    path = tmp_path / "kernels-x.so"
    os.mkfifo(path)
    with pytest.raises(native.CacheError, match="a FIFO, not a regular file"):
        native._load(path)
    path.unlink()
    path.write_bytes(b"\x7fELF")
    os.mkfifo(path.with_name(path.name + ".sha256"))
    assert native.build._read_digest(path) is None  # no record: rebuild, never load
    with pytest.raises(native.CacheError, match="do not match"):
        native._load(path)


def test_a_cache_root_that_is_a_device_names_the_variable(monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", "/dev/null")
    monkeypatch.delenv("DEEPINFER_CPU_NATIVE", raising=False)
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        assert native.library() is None
    [message] = warnings_of(caplog)
    assert "/dev/null is a character device, not a directory" in message
    assert "point DEEPINFER_CACHE_DIR at a directory of yours" in message
