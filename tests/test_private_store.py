"""The private-store rule (deepinfer.private_store) that the kernel cache, the prefix cache and the
default model share: folders 0700 of this user only, files 0600 written under an exclusive
temporary name and renamed, reads of regular private files only, without blocking, within a cap."""
from __future__ import annotations

import logging
import os
import stat

import pytest

from deepinfer.private_store import PrivateDir, StoreError, UnsafeFileError, read_private, write_private


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def store(path) -> PrivateDir:
    return PrivateDir(path, "test store", "read what is stored", setting="THE_SETTING")


def as_someone_else(monkeypatch) -> None:
    """Files made by this test belong to another user from now on: this process takes another uid
    (as root, chown would do; this works for any user)."""
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)


def test_new_folders_are_0700_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        path = store(tmp_path / "a" / "b").ensure()
    finally:
        os.umask(old)
    assert mode(tmp_path / "a") == 0o700 and mode(path) == 0o700


def test_an_own_folder_readable_by_others_is_tightened_with_a_warning(tmp_path, caplog):
    path = tmp_path / "s"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        store(path).ensure()
    assert mode(path) == 0o700
    assert str(path) in caplog.text and "0755" in caplog.text


@pytest.mark.parametrize("bits", [0o770, 0o702, 0o777], ids=oct)
def test_a_folder_writable_by_others_is_refused(tmp_path, bits):
    path = tmp_path / "s"
    path.mkdir()
    os.chmod(path, bits)
    with pytest.raises(StoreError) as err:
        store(path).ensure()
    message = str(err.value)
    assert str(path) in message and f"{bits:04o}" in message and f"chmod 700 {path}" in message
    assert "THE_SETTING" in message and "read what is stored" in message
    assert mode(path) == bits  # refused, not repaired: someone else may have put things there


def test_a_folder_of_another_user_or_a_symlink_is_refused(tmp_path, monkeypatch):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(StoreError, match="symbolic link"):
        store(tmp_path / "link").ensure()
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    as_someone_else(monkeypatch)
    # the folder itself is refused, or already the one above it (unless that is root's, as /tmp is)
    with pytest.raises(StoreError, match="not owned by you|owned by another user"):
        store(own).ensure()


def test_the_folder_above_must_not_be_writable_by_everyone_unless_sticky(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(StoreError, match="writable by everyone"):
        store(parent / "s").ensure()
    os.chmod(parent, 0o1777)  # as /tmp: only an entry's owner may rename it
    assert mode(store(parent / "s").ensure()) == 0o700


@pytest.mark.parametrize("what", ["device", "file"])
def test_a_path_through_something_that_is_not_a_directory_names_the_setting(tmp_path, what):
    blocker = "/dev/null" if what == "device" else tmp_path / "a-file"
    if what == "file":
        blocker.write_text("not a folder")
    with pytest.raises(StoreError) as err:
        store(f"{blocker}/cache/s").ensure()
    message = str(err.value)
    assert f"{blocker} is {'a character device' if what == 'device' else 'a regular file'}, not a directory" in message
    assert "point THE_SETTING at a directory of yours" in message


def test_files_are_0600_and_written_by_rename(tmp_path):
    folder = store(tmp_path / "s").ensure()
    old = os.umask(0)
    try:
        write_private(folder / "f", b"one")
    finally:
        os.umask(old)
    assert mode(folder / "f") == 0o600 and (folder / "f").read_bytes() == b"one"
    assert os.listdir(folder) == ["f"]  # no temporary file left


def test_a_symlink_planted_under_the_name_is_replaced_not_written_through(tmp_path):
    folder = store(tmp_path / "s").ensure()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (folder / "f").symlink_to(victim)
    write_private(folder / "f", b"cache")
    assert victim.read_bytes() == b"precious"
    assert not (folder / "f").is_symlink() and (folder / "f").read_bytes() == b"cache"


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    folder = store(tmp_path / "s").ensure()

    def fail(tmp: str) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_private(folder / "f", fail)
    assert os.listdir(folder) == []


def test_reads_only_regular_private_files_within_the_cap(tmp_path, no_hang, monkeypatch):
    folder = store(tmp_path / "s").ensure()
    write_private(folder / "ok", b"12345")
    data, st = read_private(folder / "ok", 5)
    assert data == b"12345" and st.st_size == 5
    with pytest.raises(UnsafeFileError, match="more than the 4"):
        read_private(folder / "ok", 4)
    os.mkfifo(folder / "fifo")
    with pytest.raises(UnsafeFileError, match="a FIFO, not a regular file"):
        read_private(folder / "fifo", 100)  # no writer: a blocking open would wait forever
    (folder / "link").symlink_to(folder / "ok")
    with pytest.raises(OSError):
        read_private(folder / "link", 100)
    (folder / "sub").mkdir()
    with pytest.raises(UnsafeFileError, match="a directory"):
        read_private(folder / "sub", 100)
    os.chmod(folder / "ok", 0o620)
    with pytest.raises(UnsafeFileError, match="writable by its group"):
        read_private(folder / "ok", 100)
    os.chmod(folder / "ok", 0o600)
    as_someone_else(monkeypatch)
    with pytest.raises(UnsafeFileError, match="not owned by you"):
        read_private(folder / "ok", 100)
