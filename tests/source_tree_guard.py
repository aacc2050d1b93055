"""Tests never write into the source tree. `SourceTreeGuard`, an audit hook (sys.addaudithook) that
conftest.py installs for the session, refuses with PermissionError every change this process tries
to make in the checkout (opening a file for writing, creating, renaming, removing, chmod...), and
records it, so that the test that tried fails even where the code under test swallows the error.
Bytecode caches (`__pycache__`), the virtual environment, pytest's own cache and git's folder are
not watched, nor is a path the run was explicitly asked to write (`allow`, e.g. a baseline file a
command-line option names). Child processes are not watched.
"""
from __future__ import annotations

import os
from pathlib import Path

#: top-level entries of the checkout that are not source: the environment and the tools' own state
UNWATCHED = (".venv", ".pytest_cache", ".git")

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# audit events that change the file system: (index of a path argument, index of its dir_fd or None)
_CHANGES: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.mkdir": ((0, 2),), "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.rename": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),), "os.link": ((1, 3),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
    "os.truncate": ((0, None),), "os.utime": ((0, 3),), "shutil.rmtree": ((0, None),),
}


class SourceTreeGuard:
    def __init__(self, repo: Path) -> None:
        self.repo = str(repo) + os.sep
        self.unwatched = tuple(self.repo + name for name in UNWATCHED)
        self.allowed: set[str] = set()
        self.attempts: list[str] = []

    def watches(self, path: str | os.PathLike) -> bool:
        """Whether a write to `path` (absolute, or relative to the working directory) is refused."""
        full = os.path.abspath(os.fsdecode(path))
        if not full.startswith(self.repo) or "__pycache__" in full.split(os.sep):
            return False
        if any(full == path or full.startswith(path + ".") for path in self.allowed):
            return False
        return not any(full == root or full.startswith(root + os.sep) for root in self.unwatched)

    def allow(self, path: str | os.PathLike) -> None:
        """Let the session write `path`, a file a command-line option asked the run to write, and the
        files named after it (`path.lock`, `path.tmp`: what a careful writer keeps beside it)."""
        self.allowed.add(os.path.abspath(os.fsdecode(path)))

    def __call__(self, event: str, args: tuple) -> None:
        if event == "open":
            _, mode, flags = args
            writes = flags & _WRITE_FLAGS if isinstance(flags, int) else any(c in (mode or "") for c in "wax+")
            paths = ((args[0], None),) if writes else ()
        else:
            paths = _CHANGES.get(event, ())
            paths = tuple((args[i], args[fd] if fd is not None and fd < len(args) else None)
                          for i, fd in paths if i < len(args))
        for path, dir_fd in paths:
            if event == "os.mkdir" and isinstance(path, (str, bytes, os.PathLike)) and os.path.isdir(path):
                continue  # an existing folder (mkdir(exist_ok=True)): nothing changes
            self._check(path, dir_fd)

    def _check(self, path, dir_fd) -> None:
        if path is None or isinstance(path, int):  # a file descriptor: opened (and checked) before
            return
        name = os.fsdecode(path)
        if not os.path.isabs(name) and dir_fd not in (None, -1):  # relative to a directory descriptor
            return
        if self.watches(name):
            full = os.path.abspath(name)
            self.attempts.append(full)
            raise PermissionError(f"tests must not write into the source tree: {full}; write into tmp_path")
