"""What a checkpoint path is, without opening it (import-light: no torch).

`regular_file(path, what)` tells a missing file (False) from a regular one (True) and refuses
anything else by name: a directory, a named pipe (opening one blocks until a writer comes, so
nothing here is opened), a device such as /dev/zero (endless bytes), a socket, or a symlink to
nothing. Before, each of these was reported as a file that "does not exist".
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from deepinfer.models.common.errors import CheckpointError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def regular_file(path: Path, what: str) -> bool:
    """Whether `path` (symlinks followed) is a regular file: False when nothing is there; a
    CheckpointError naming `what`, the path and what is there instead when it is something else (a
    directory, a FIFO, a device such as /dev/zero, a socket) or a symlink to nothing. Nothing is
    opened, so a FIFO cannot hang the load."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise CheckpointError(f"{what} {path} is a symlink to {os.readlink(path)}, which does not exist") from None
        return False
    except OSError as e:
        raise CheckpointError(f"{what} {path} cannot be read: {e}") from None
    if stat.S_ISREG(mode):
        return True
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    raise CheckpointError(f"{what} {path} is {kind}, not a regular file; put the real file there")
