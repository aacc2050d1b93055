"""Tests never write into the source tree. `SourceTreeGuard`, an audit hook (sys.addaudithook) that
conftest.py installs for the session, refuses with PermissionError every change this process tries
to make under the project's folders (opening a file for writing, creating, renaming, removing,
chmod...), and records it, so that the test that tried fails even where the code under test
swallows the error. Bytecode caches (`__pycache__`) are allowed. Child processes are not watched.
"""
from __future__ import annotations

import os
from pathlib import Path

#: the project's folders (its top level holds only packaging files, .pytest_cache and .venv)
SOURCE_FOLDERS = ("core", "plugins", "tests", "examples", "scripts", "docs", ".ci")

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# audit events that change the file system: (index of a path argument, index of its dir_fd or None)
_CHANGES: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.mkdir": ((0, 2),), "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.rename": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),), "os.link": ((1, 3),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
    "os.truncate": ((0, None),), "os.utime": ((0, 3),), "shutil.rmtree": ((0, None),),
}


class SourceTreeGuard:
    def __init__(self, repo: Path) -> None:
        self.roots = tuple(str(repo / folder) + os.sep for folder in SOURCE_FOLDERS)
        self.attempts: list[str] = []

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
            self._check(path, dir_fd)

    def _check(self, path, dir_fd) -> None:
        if path is None or isinstance(path, int):  # a file descriptor: opened (and checked) before
            return
        name = os.fsdecode(path)
        if not os.path.isabs(name) and dir_fd not in (None, -1):  # relative to a directory descriptor
            return
        full = os.path.abspath(name)
        if full.startswith(self.roots) and "__pycache__" not in full.split(os.sep):
            self.attempts.append(full)
            raise PermissionError(f"tests must not write into the source tree: {full}; write into tmp_path")
