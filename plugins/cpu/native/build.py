"""Build, cache and load the C kernels of the cpu back end (the C files next to this module, one per
op family, sharing common.h / gemv.h: SOURCES, HEADERS).

`library()` compiles every C file once, together, with the system C compiler (`$CC`, else `cc`)
into one shared library in `$DEEPINFER_CACHE_DIR/cpu_native/` (default ~/.cache/deepinfer/cpu_native/),
under a name keyed by all the sources and headers, the compiler's version, the flags and the CPU,
and loads it with ctypes (one dlopen). Without a working compiler, or with a cache directory that
cannot be used safely, it logs one warning and returns None: the pure-torch kernels are used
instead.

The cache holds code this process will run, so it follows the private-store rule of
`deepinfer.private_store` (the directory is created 0700 and must belong to this user and be
writable by nobody else; files are written under an exclusive temporary name and renamed, and
opened without following symlinks or blocking, regular files of this user only). On top of it
(`_compile`, `_open_verified`), each library's sha256 is recorded next to it
(`kernels-<key>.so.sha256`), and a library is loaded only from the file descriptor whose contents
matched that record. A missing or wrong record means rebuild, never load.

`DEEPINFER_CPU_NATIVE_ISA` picks a build switch (`BUILD_VARIANTS`): all the CPU offers, or a build
without AMX, without AVX512-BF16 (both `-march=native` with those masked off), or what a CPU one
tier down builds: `no-avx512` compiles for x86-64-v3 (AVX2 + FMA, as an AVX2 CPU does) and
`no-avx2` for x86-64-v2 (the plain C paths). A CPU below such a level compiles for itself with the
switch's instruction sets masked off instead (`_BELOW_LEVEL`), so a build never holds an
instruction the CPU lacks.

The ctypes prototypes are declared by the binding modules (binding.Kernel, all imported by the
package's __init__); `_load` applies every declared one to the loaded library.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import hmac
import logging
import os
import shlex
import subprocess
from pathlib import Path

# torch first: its libgomp.so.1 is then already loaded, and the loader resolves the library's
# libgomp.so.1 dependency to that copy (two OpenMP runtimes would oversubscribe the cores).
import torch

from deepinfer import envs
from deepinfer.private_store import (PrivateDir, StoreError, UnsafeFileError, cache_root, open_private, read_private,
                                     write_private)
from deepinfer_plugins.cpu.native import binding

logger = logging.getLogger("deepinfer")

HERE = Path(__file__).parent
# The C files, one per op family, compiled together into the one library (named, not globbed: a stale
# file left in a build tree must not join the build); the headers they include are part of the cache key.
SOURCES = tuple(HERE / name for name in ("isa.c", "norm_rope.c", "mhc.c", "activation.c", "gemv.c", "experts.c",
                                         "attention.c", "moe_rows.c", "sampling.c",
                                         "quant_gemv.c", "quant_experts.c", "selection.c", "packed_gemm.c",
                                         "moe_layer.c", "compressor.c", "attention_layer.c", "kv_cache.c",
                                         "indexer.c"))
HEADERS = tuple(HERE / name for name in ("common.h", "gemv.h", "quant.h", "sink_attention.h", "kv_codes.h"))
# Every build's flags; the build switch adds its target (-march) and the rest (build_flags).
FLAGS = ("-O3", "-mprefer-vector-width=512", "-fPIC", "-shared", "-fopenmp")
# Build switches (DEEPINFER_CPU_NATIVE_ISA): the flags after FLAGS. The C files pick their AMX,
# AVX512-BF16, AVX2/FMA and portable paths at compile time, so each switch compiles the next path
# down. The two lowest compile what a CPU of that tier builds, not this CPU with a feature masked
# off: `-march=native -mno-avx512f` on an AVX-512 CPU still has its other extensions (VAES, GFNI,
# AVX-VNNI, ...) and its tuning, which an AVX2 CPU's build has not. x86-64-v3 is AVX2, FMA, BMI1/2,
# F16C, LZCNT and MOVBE (every AVX2 CPU's), x86-64-v2 SSE4.2, SSSE3 and POPCNT; both tune generic.
BUILD_VARIANTS: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    "no-amx": ("-march=native", "-mno-amx-tile", "-mno-amx-bf16"),
    "no-avx512bf16": ("-march=native", "-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16"),
    # The define makes common.h refuse to compile if any AVX-512 (or AMX) macro is still on.
    "no-avx512": ("-march=x86-64-v3", "-DDEEPINFER_NO_AVX512"),
    "no-avx2": ("-march=x86-64-v2", "-DDEEPINFER_NO_AVX512"),
}
# The /proc/cpuinfo flags an x86-64 level's instructions need (lzcnt is `abm`, OSXSAVE shows as `xsave`).
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
X86_64_LEVELS: dict[str, frozenset[str]] = {
    "x86-64-v2": _V2,
    "x86-64-v3": _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
}
# A switch's flags on a CPU below its level (a VM that hides MOVBE, a CPU without SSE4.2), or where
# the CPU's flags are unknown: this CPU's own build with what the switch removes masked off
# (-mno-avx512f switches off every AVX-512 extension; -mno-avx512f alone leaves AMX on, gcc 12).
_BELOW_LEVEL: dict[str, tuple[str, ...]] = {
    "no-avx512": ("-march=native", "-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-DDEEPINFER_NO_AVX512"),
    "no-avx2": ("-march=native", "-mno-avx2", "-mno-fma", "-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16",
                "-DDEEPINFER_NO_AVX512"),
}
# build_isa()'s bits (isa.c)
ISA_BITS = {"avx2": 1, "fma": 2, "avx512f": 4, "avx512bf16": 8, "amx": 16}
# what each switch leaves out of the build (build_isa names), and the /proc/cpuinfo flags of each name
SWITCHED_OFF: dict[str, frozenset[str]] = {
    "native": frozenset(), "no-amx": frozenset({"amx"}), "no-avx512bf16": frozenset({"avx512bf16", "amx"}),
    "no-avx512": frozenset({"avx512f", "avx512bf16", "amx"}),
    "no-avx2": frozenset({"avx2", "fma", "avx512f", "avx512bf16", "amx"})}
_CPU_FLAGS = {"avx2": ("avx2",), "fma": ("fma",), "avx512f": ("avx512f",), "avx512bf16": ("avx512_bf16",),
              "amx": ("amx_tile", "amx_bf16", "avx512_bf16")}
# A whole build takes ~30-60 s on two idle cores; a loaded machine (a parallel test run) has taken over
# 120 s, so the limit only catches a compiler that hangs.
COMPILE_TIMEOUT_S = 900
# A recorded digest is one line of 64 hex digits; anything longer is not ours.
_DIGEST_FILE_MAX = 256


class CompilerError(RuntimeError):
    """The C compiler is missing or failed."""


#: The kernel cache directory or a file in it cannot be used (safely); the message names the path,
#: what is wrong and the fix. The private-store rule's error, under the name this back end used first.
CacheError = StoreError


def enabled() -> bool:
    """False when DEEPINFER_CPU_NATIVE=0 asks for the pure-torch kernels."""
    return envs.get_bool("DEEPINFER_CPU_NATIVE", True)


def build_variant() -> str:
    """The build switch DEEPINFER_CPU_NATIVE_ISA selects (default "native")."""
    name = (envs.get("DEEPINFER_CPU_NATIVE_ISA") or "native").strip().lower()
    if name not in BUILD_VARIANTS:
        raise ValueError(f"DEEPINFER_CPU_NATIVE_ISA={name!r} is not a build switch; use one of "
                         f"{', '.join(BUILD_VARIANTS)}")
    return name


def build_flags(variant: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a build switch (default: the one DEEPINFER_CPU_NATIVE_ISA selects) on this
    CPU: its x86-64 level where the CPU has every feature of it, else `_BELOW_LEVEL`'s flags."""
    variant = build_variant() if variant is None else variant
    flags = BUILD_VARIANTS[variant]
    level = X86_64_LEVELS.get(flags[0].removeprefix("-march="))
    if level is not None:
        cpu = _cpu_flag_set()
        if cpu is None or not level <= cpu:
            flags = _BELOW_LEVEL[variant]
    return FLAGS + flags


def cache_dir() -> Path:
    return cache_root() / "cpu_native"


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _private_dir(path: Path) -> PrivateDir:
    return PrivateDir(path, "kernel cache directory", "plant a library there that this process would run")


def _cache_directory() -> Path:
    """The library directory, created 0700 when missing, else checked (CacheError)."""
    return _private_dir(cache_dir()).ensure()


def _digest_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _compile(target: Path, compiler: list[str], flags: tuple[str, ...] = FLAGS) -> str:
    """Compile to a temporary name next to `target`, record its sha256 in `<target>.sha256`, rename
    both into place; returns the digest. Processes building at the same time each produce complete
    files and the last rename wins."""
    digest = ""

    def build(tmp: str) -> None:
        nonlocal digest
        try:
            out = subprocess.run([*compiler, *flags, "-o", tmp, *map(str, SOURCES)], capture_output=True,
                                 text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            raise CompilerError(f"running `{' '.join(compiler)}` failed: {exc}") from exc
        if out.returncode != 0:
            raise CompilerError((out.stderr or out.stdout).strip() or f"exit status {out.returncode}")
        with open(tmp, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()

    try:
        write_private(target, build, mode=0o700)
        write_private(_digest_path(target), (digest + "\n").encode())
    except OSError as exc:
        raise _private_dir(target.parent).unwritable(exc) from exc
    return digest


def _read_digest(target: Path) -> str | None:
    """The sha256 recorded for `target`, or None when there is no (well-formed, private) record."""
    try:
        data, _ = read_private(_digest_path(target), _DIGEST_FILE_MAX)
    except OSError:
        return None
    text = data.decode("ascii", "replace").strip()
    return text.lower() if len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text) else None


def _open_verified(target: Path) -> tuple[int, bool]:
    """Open `target` under the private-store rule (not through a symlink, without blocking; a
    regular file of this user that its group and others cannot write: UnsafeFileError otherwise)
    and check that its sha256 is the recorded one. Returns (fd, matches); the caller closes the
    fd. OSError when it cannot be opened."""
    fd = open_private(target)
    try:
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        recorded = _read_digest(target)
        return fd, recorded is not None and hmac.compare_digest(h.hexdigest(), recorded)
    except BaseException:
        os.close(fd)
        raise


def _cpuinfo_flags() -> str | None:
    """The CPU's feature flags as /proc/cpuinfo lists them (Linux), else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_flag_set() -> frozenset[str] | None:
    flags = _cpuinfo_flags()
    return None if flags is None else frozenset(flags.split())


def _cpu_features() -> str:
    """What `-march=native` compiles for: the CPU's feature flags (Linux), else torch's ISA level. Part
    of the cache key, so a cache directory shared between different CPUs never hands one of them a
    library with instructions it lacks (and a switch's level or fallback follows the CPU too)."""
    return _cpuinfo_flags() or torch.backends.cpu.get_cpu_capability()


def planned_isa() -> frozenset[str] | None:
    """The instruction sets (ISA_BITS names) a build with the selected switch compiles for on this CPU,
    from /proc/cpuinfo without compiling (None where it is missing): what `deepinfer doctor` shows.
    A switch's x86-64 level holds exactly what it keeps of ISA_BITS (AVX2 and FMA for x86-64-v3,
    neither for v2) and is used only on a CPU that has all of the level, so this is the CPU's set
    less what the switch removes, with a level or without."""
    flags = _cpu_flag_set()
    if flags is None:
        return None
    have = frozenset(name for name, needed in _CPU_FLAGS.items() if set(needed) <= flags)
    return have - SWITCHED_OFF[build_variant()]


def planned_target() -> str:
    """The selected switch's `-march` target on this CPU (`native`, `x86-64-v3`, `x86-64-v2`), for
    `deepinfer doctor`."""
    return next(f for f in build_flags() if f.startswith("-march=")).removeprefix("-march=")


def _build() -> Path:
    """The path of a library in the cache for this source, compiler, switch and CPU whose contents
    match their recorded sha256, compiled (again) when there is none."""
    directory = _cache_directory()
    compiler, flags = _compiler(), build_flags()
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CompilerError(f"running `{' '.join(compiler)} --version` failed: {exc}") from exc
    if version.returncode != 0:
        raise CompilerError(f"`{' '.join(compiler)} --version` failed: {(version.stderr or version.stdout).strip()}")
    sources = [part for path in (*SOURCES, *HEADERS) for part in (path.name.encode(), path.read_bytes())]
    key = hashlib.sha256(b"\0".join([*sources, version.stdout.encode(), " ".join(flags).encode(),
                                      " ".join(compiler).encode(), _cpu_features().encode()])).hexdigest()[:16]
    target = directory / f"kernels-{key}.so"
    try:
        fd, matches = _open_verified(target)
        os.close(fd)
    except FileNotFoundError:
        matches = None
    except OSError as exc:  # a symlink (O_NOFOLLOW), a FIFO, a file that is not a private one of yours
        logger.warning("deepinfer: cannot use the cached kernel library %s (%s); rebuilding it", target, exc)
        matches = None
    if matches is False:
        if _read_digest(target) is None:
            logger.info("deepinfer: the cached kernel library %s has no recorded sha256; rebuilding it", target)
        else:
            logger.warning("deepinfer: the cached kernel library %s does not match its recorded sha256; not "
                           "loading it, rebuilding it", target)
    if not matches:
        _compile(target, compiler, flags)
    return target


# Descriptors of the loaded libraries, kept open for the life of the process: the loader knows each
# library by its /proc/self/fd/N name, which must not come back for another file.
_LOADED_FDS: list[int] = []


def _load(path: Path) -> ctypes.CDLL:
    """Load the library at `path` after checking it against its recorded sha256 (CacheError when it
    does not match). On Linux the verified descriptor itself is loaded, so the file cannot be
    swapped between the check and the load."""
    fix = f"Fix: delete both files so that the library is rebuilt, and check who can write {path.parent}"
    try:
        fd, matches = _open_verified(path)
    except UnsafeFileError as exc:
        raise CacheError(f"refusing to load {path}: {exc}. {fix}") from exc
    if not matches:
        os.close(fd)
        raise CacheError(f"refusing to load {path}: its contents do not match the sha256 recorded in "
                         f"{_digest_path(path)}. {fix}")
    by_fd = f"/proc/self/fd/{fd}"
    if os.path.exists(by_fd):
        try:
            lib = ctypes.CDLL(by_fd)
        except BaseException:
            os.close(fd)
            raise
        _LOADED_FDS.append(fd)
    else:
        os.close(fd)
        lib = ctypes.CDLL(str(path))
    for kernel in binding.KERNELS:
        kernel.declare(lib)
    return lib


_BUILD_ISA = binding.Kernel("build_isa")


def build_isa(lib: ctypes.CDLL) -> frozenset[str]:
    """The instruction sets the library was compiled for (keys of ISA_BITS)."""
    bits = _BUILD_ISA(lib)
    return frozenset(name for name, bit in ISA_BITS.items() if bits & bit)


def _sources() -> str:
    return f"{HERE}/{{{','.join(path.name for path in SOURCES)}}}"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (one warning) when they cannot be built or loaded."""
    head = ("deepinfer: the native C kernels of the cpu back end are unavailable, the slower pure-torch kernels are "
            "used instead.")
    silence = "set DEEPINFER_CPU_NATIVE=0 to silence this warning."
    try:
        return _load(_build())
    except CompilerError as exc:
        logger.warning("%s Building %s with `%s` failed: %s. Fix: install a C compiler with OpenMP support (e.g. "
                       "`apt-get install gcc`) or point $CC at one; %s", head, _sources(), " ".join(_compiler()), exc,
                       silence)
    except CacheError as exc:
        logger.warning("%s %s; %s", head, exc, silence)
    except OSError as exc:
        logger.warning("%s Loading the library built from %s failed: %s. Fix: delete %s so that it is rebuilt; %s",
                       head, _sources(), exc, cache_dir(), silence)
    return None


def active_library() -> ctypes.CDLL | None:
    """The library when enabled (DEEPINFER_CPU_NATIVE) and buildable, else None."""
    return library() if enabled() else None


