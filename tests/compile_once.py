"""A C compiler command for tests that build the cpu back end's kernels into temporary folders: it runs
the real compiler once per distinct build and a session, and hands later identical builds a copy.

    python compile_once.py MEMO_DIR REAL_COMPILER [compiler arguments...]

The kernel-cache tests compile the whole library into a fresh cache again and again (that is their
subject: who builds, what is recorded, what is rebuilt), and the build-switch tests compile switches
that are the same build on this CPU (`no-amx` where the CPU has no AMX compiles what `native`
compiles). A build is identified by what decides the code: the instruction sets and tuning the target
flags (-march=..., -mno-...) give, as the compiler's predefined macros; every other flag; and the
name and contents of each input file with the headers beside it. Calls without `-o` (`--version`,
`-E`) go to the real compiler unchanged. Builds that fail are not kept.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_FLAGS = ("-march=", "-mno-")


def _predefined_macros(compiler: list[str], target: list[str]) -> bytes:
    out = subprocess.run([*compiler, *target, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, check=True)
    return b"\n".join(sorted(out.stdout.splitlines()))


def build_key(compiler: list[str], args: list[str]) -> str:
    """The identity of a build: `args` without its output, the target flags as the macros they define."""
    h = hashlib.sha256()
    target = [a for a in args if a.startswith(TARGET_FLAGS)]
    h.update(_predefined_macros(compiler, target))
    headers: set[Path] = set()
    for arg in args:
        path = Path(arg)
        if arg.startswith(TARGET_FLAGS):
            continue
        if not arg.startswith("-") and path.is_file():
            h.update(b"\0file\0" + path.name.encode() + b"\0" + path.read_bytes())
            headers.update(path.parent.glob("*.h"))
        else:
            h.update(b"\0arg\0" + arg.encode())
    for header in sorted(headers):
        h.update(b"\0header\0" + header.name.encode() + b"\0" + header.read_bytes())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    memo, compiler, args = Path(argv[0]), shlex.split(argv[1]), argv[2:]
    if "-o" not in args:
        return subprocess.run([*compiler, *args]).returncode
    i = args.index("-o")
    output, inputs = Path(args[i + 1]), args[:i] + args[i + 2:]
    kept = memo / (build_key(compiler, inputs) + ".out")
    if not kept.exists():
        fd, tmp = tempfile.mkstemp(dir=memo, suffix=".tmp")
        os.close(fd)
        rc = subprocess.run([*compiler, *inputs, "-o", tmp]).returncode
        if rc != 0:
            os.unlink(tmp)
            return rc
        os.replace(tmp, kept)  # concurrent identical builds: each complete, the last rename wins
    output.unlink(missing_ok=True)  # as the linker does: a new file, not the old one rewritten
    shutil.copy(kept, output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
