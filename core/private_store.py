"""Private stores: the folders where deepinfer keeps files it generated and reads back later.

The cpu back end's kernel cache (code this process runs), the prefix cache (model state of the
prompts a server was sent) and the embedded default model (weights the engine loads) follow one
rule, written here once:

* **The folder** is created 0700 (and so is each missing folder above it). An existing one must be a
  real directory (not a symlink) owned by this user and writable by nobody else, else `StoreError`
  (path, mode, owner, the fix). Read and search bits of group and others are dropped, with a
  warning: they let others read what is cached (whether a guessed prompt was served, say), never
  write it, so tightening them breaks nobody.
* **The folder above it**, whose writers could rename the store away and put their own in its place,
  must belong to this user or root and must not be writable by everyone unless sticky (as /tmp).
* **Files** are written to an exclusive temporary name (`O_CREAT|O_EXCL|O_NOFOLLOW`, mode 0600) in
  the same folder and renamed into place: a symlink or file planted under any name is never written
  through, and readers see the old file or the complete new one.
* **Reading** opens without following a symlink and without blocking (a FIFO planted under a cache
  name would otherwise wait forever for a writer), and accepts only a regular file of this user that
  nobody else can write, no larger than the caller's cap, before a byte is read.

A checksum stored next to or inside a file guards against corruption (a torn write, a bad disk),
not against tampering: whoever can write the file can write its checksum too. The folder's privacy
is what guards against tampering.
"""
from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from deepinfer import envs

logger = logging.getLogger("deepinfer")

CACHE_DIR_VAR = "DEEPINFER_CACHE_DIR"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class StoreError(RuntimeError):
    """A private store's folder or file cannot be used (safely); the message names the path, what is
    wrong and the fix."""


class UnsafeFileError(OSError):
    """A file in a store that is not a regular file of this user that nobody else can write, or that
    is larger than the reader's cap: it is never read."""


def cache_root() -> Path:
    """Where deepinfer keeps generated files: `DEEPINFER_CACHE_DIR`, default ~/.cache/deepinfer."""
    configured = envs.get(CACHE_DIR_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "deepinfer"


def owner_name(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _describe(st: os.stat_result) -> str:
    return (f"mode {stat.filemode(st.st_mode)} {stat.S_IMODE(st.st_mode):04o}, owner {owner_name(st.st_uid)}; "
            f"this process runs as {owner_name(os.getuid())}")


class PrivateDir:
    """One store's folder and how errors talk about it.

    `what` names it ("kernel cache directory"), `stake` says what someone else could do with it if it
    were theirs to write ("plant a library there that this process would run"), `setting` is where
    the user points it elsewhere ("DEEPINFER_CACHE_DIR")."""

    def __init__(self, path: str | os.PathLike, what: str, stake: str, setting: str = CACHE_DIR_VAR):
        self.path = Path(path).expanduser()
        self.what = what
        self.stake = stake
        self.setting = setting

    def ensure(self) -> Path:
        """The folder, created 0700 when missing, else checked (StoreError) and tightened to 0700."""
        try:
            self._make()
            self._check_parent(self.path.parent)
            st = os.lstat(self.path)
            self._check_folder(self.path, st)
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(self.path, 0o700)
                logger.warning("deepinfer: the %s %s was readable by others (mode %04o); made it 0700", self.what,
                               self.path, stat.S_IMODE(st.st_mode))
        except StoreError:
            raise
        except OSError as exc:
            raise self.unwritable(exc) from exc
        return self.path

    def unwritable(self, exc: OSError) -> StoreError:
        """The error for an OSError while creating or writing the folder."""
        return StoreError(f"cannot create or write the {self.what} {self.path}: {exc}. Fix: make it writable by you "
                          f"(e.g. `mkdir -p {self.path} && chmod 700 {self.path}`) or point {self.setting} at a "
                          f"directory you own")

    def check_tree(self, top: Path, fix: str) -> None:
        """`top` (inside the folder) and everything under it: no symlink, owned by this user, writable
        by nobody else; else StoreError naming the first offender and `fix`."""
        self._check_entry(top, fix)
        for folder, dirs, files in os.walk(top, onerror=_raise):  # symlinks are listed, never followed
            for name in dirs + files:
                self._check_entry(Path(folder) / name, fix)

    # -- the rule ---------------------------------------------------------------------------------

    def _refuse(self, path: Path, st: os.stat_result, problem: str, fix: str) -> StoreError:
        subject = ("it" if path == self.path else f"the folder above it, {path}," if path == self.path.parent
                   else f"{path} in it")
        return StoreError(f"refusing the {self.what} {self.path}: {subject} {problem} ({_describe(st)}), so someone "
                          f"else could {self.stake}. Fix: {fix}, or point {self.setting} at a directory only you can "
                          f"write")

    def _make(self) -> None:
        """Create the missing folders down to the store's, each 0700 (whatever the umask)."""
        missing = []
        path = self.path
        while not os.path.lexists(path):
            missing.append(path)
            path = path.parent
        if not missing:
            return
        if not path.is_dir():  # e.g. DEEPINFER_CACHE_DIR=/dev/null, or a file
            raise StoreError(f"cannot create or write the {self.what} {self.path}: {path} is "
                             f"{_kind(os.stat(path).st_mode)}, "
                             f"not a directory. Fix: point {self.setting} at a directory of yours (it is created "
                             f"if missing)")
        for folder in reversed(missing):
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:  # made meanwhile by another process: checked below like any other
                continue
            os.chmod(folder, 0o700)

    def _check_folder(self, path: Path, st: os.stat_result) -> None:
        if not stat.S_ISDIR(st.st_mode):
            raise self._refuse(path, st, f"is {_kind(st.st_mode)}, not a directory",
                               f"replace it with a directory of yours (`rm {path} && mkdir -m 700 {path}`)")
        problem = _foreign(st)
        if problem is not None:
            raise self._refuse(path, st, problem, (
                f"remove it (`rm -r {path}`; it is made again, 0700) or `chown` it to yourself and `chmod 700 {path}`"
                if st.st_uid != os.getuid() else
                f"`chmod 700 {path}` (and delete what is in it if you did not put it there)"))

    def _check_parent(self, path: Path) -> None:
        st = os.stat(path)
        if st.st_uid not in (os.getuid(), 0):
            raise self._refuse(path, st, "is owned by another user", "use a directory of your own")
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise self._refuse(path, st, "is writable by everyone (and not sticky)",
                               f"`chmod o-w {path}` (or `chmod +t`)")

    def _check_entry(self, path: Path, fix: str) -> None:
        st = os.lstat(path)
        problem = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else _foreign(st)
        if problem is not None:
            raise self._refuse(path, st, problem, fix)


def _foreign(st: os.stat_result) -> str | None:
    """Why someone else could have written this folder or file (None: nobody could, but root)."""
    if st.st_uid != os.getuid():
        return "is not owned by you"
    if st.st_mode & _WRITABLE_BY_OTHERS:
        return f"is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'}"
    return None


def _raise(exc: OSError) -> None:
    raise exc


def write_private(target: Path, content: bytes | Callable[[str], None], mode: int = 0o600) -> None:
    """Replace `target` in one rename with a new file of `mode`, written under an exclusive temporary
    name next to it: `content`'s bytes, or whatever `content(tmp_path)` writes there (a compiler's
    output, say). OSError when it cannot be written; no temporary file is left behind."""
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600)
    try:
        if callable(content):
            os.close(fd)
            content(str(tmp))
            os.chmod(tmp, mode)  # the writer may have made the file anew, with its own mode
        else:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode)
                f.write(content)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def open_private(path: Path, max_bytes: int | None = None) -> int:
    """A read-only descriptor of `path` (the caller closes it), opened without following a symlink
    and without blocking. UnsafeFileError unless it is a regular file of this user that nobody
    else can write, of at most `max_bytes`; other OSErrors when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            problem = f"is {_kind(st.st_mode)}, not a regular file"
        elif (foreign := _foreign(st)) is not None:
            problem = f"{foreign} (mode {stat.S_IMODE(st.st_mode):04o}, owner {owner_name(st.st_uid)})"
        elif max_bytes is not None and st.st_size > max_bytes:
            problem = f"holds {st.st_size} bytes, more than the {max_bytes} it may"
        else:
            return fd
        raise UnsafeFileError(f"{path} {problem}; it is not read")
    except BaseException:
        os.close(fd)
        raise


def read_private(path: Path, max_bytes: int) -> tuple[bytes, os.stat_result]:
    """The contents of `path` and its stat, under `open_private`'s rules."""
    fd = open_private(path, max_bytes)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
        st = os.fstat(f.fileno())
    if len(data) > max_bytes:  # it grew after the check
        raise UnsafeFileError(f"{path} holds more than the {max_bytes} bytes it may; it is not read")
    return data, st
