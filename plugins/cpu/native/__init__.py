"""Build, cache and call the fused C kernels of the cpu back end (kernels.c next to this file).

`library()` compiles kernels.c once with the system C compiler (`$CC`, else `cc`) into
`$DEEPINFER_CACHE_DIR/cpu_native/` (default ~/.cache/deepinfer/cpu_native/), under a name keyed by
the source, the compiler's version, the flags and the CPU, and loads it with ctypes. Without a
working compiler, or with a cache directory that cannot be used safely, it logs one warning and
returns None: the pure-torch kernels are used instead.

The cache holds code this process will run, so it is guarded (see `_cache_directory`, `_compile`
and `_open_verified`): the directory must belong to this user and be writable by nobody else (it is
created 0700), a library is written under a temporary name and renamed, its sha256 is recorded
next to it (`kernels-<key>.so.sha256`, also written atomically), and a library is loaded only
from the file descriptor whose contents matched that record. A missing or wrong record means
rebuild, never load.

`DEEPINFER_CPU_NATIVE_ISA` picks a build switch (`BUILD_VARIANTS`): all the CPU offers, or a build
without AMX, without AVX512-BF16, or without any AVX-512.

The wrappers below take torch tensors and return new ones, or None when the input is outside what
the C code handles (device, dtype, layout), so the caller falls back to the reference kernel.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import hmac
import logging
import os
import shlex
import stat
import subprocess
import tempfile
from pathlib import Path

# torch first: its libgomp.so.1 is then already loaded, and the loader resolves the library's
# libgomp.so.1 dependency to that copy (two OpenMP runtimes would oversubscribe the cores).
import torch

from deepinfer import envs

logger = logging.getLogger("deepinfer")

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fPIC", "-shared", "-fopenmp")
# Build switches (DEEPINFER_CPU_NATIVE_ISA): extra flags after FLAGS. kernels.c picks its AMX,
# AVX512-BF16 and portable paths at compile time, so each switch compiles the next path down; on a
# CPU without the feature a switch changes nothing (and the build is still checked).
BUILD_VARIANTS: dict[str, tuple[str, ...]] = {
    "native": (),
    "no-amx": ("-mno-amx-tile", "-mno-amx-bf16"),
    "no-avx512bf16": ("-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16"),
    # -mno-avx512f switches off every AVX-512 extension (BW, VL, BF16, FP16, ...); AMX goes too (its
    # path needs AVX512-BF16). The define makes kernels.c refuse to compile if AVX-512 is still on.
    "no-avx512": ("-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-DDEEPINFER_NO_AVX512"),
}
# build_isa()'s bits (kernels.c)
ISA_BITS = {"avx2": 1, "fma": 2, "avx512f": 4, "avx512bf16": 8, "amx": 16}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_PROTOTYPES = {
    "rms_norm": (_p, _l, _p, _i, _p, _l, _l, _f, _i, _i),
    "rotary": (_p, _l, _l, _p, _p, _p, _l, _l, _l, _l, _i, _i, _i),
    "hc_pre": (_p, _p, _p, _p, _p, _p, _p, _l, _l, _l, _i, _f, _f, _i, _i),
    "hc_post": (_p, _i, _p, _p, _p, _p, _l, _l, _l, _i, _i),
    "swiglu": (_p, _p, _l, _p, _l, _l, _f, _i, _i),
    "gemv_bf16": (_p, _p, _p, _l, _l, _i),
    "experts_bf16": (_p, _l, _l, _p, _l, _p, _p, _l, _f, _p, _p, _p, _i),
    "argmax_logsumexp": (_p, _l, _l, _l, _p, _p, _i),
    "grouped_gemv_bf16": (_p, _p, _p, _l, _l, _l, _i),
    "amx_usable": (),
    "build_isa": (),
    "grouped_amx_bf16": (_p, _l, _l, _l, _p, _l, _p, _i),
    "sink_attention_decode": (_p, _p, _p, _p, _f, _p, _l, _l, _l, _l, _l, _i, _i),
    "moe_dispatch_rows": (_p, _l, _l, _l, _p, _l, _p, _p, _p, _p, _p, _i),
    "moe_combine_rows": (_p, _i, _l, _p, _p, _l, _l, _p, _p, _p, _i),
}

# A recorded digest is one line of 64 hex digits; anything longer is not ours.
_DIGEST_FILE_MAX = 256


class CompilerError(RuntimeError):
    """The C compiler is missing or failed."""


class CacheError(RuntimeError):
    """The kernel cache directory or a file in it cannot be used (safely); the message names the
    path, what is wrong and the fix."""


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
    """The compiler flags of a build switch (default: the one DEEPINFER_CPU_NATIVE_ISA selects)."""
    return FLAGS + BUILD_VARIANTS[build_variant() if variant is None else variant]


def cache_root() -> Path:
    configured = envs.get("DEEPINFER_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "deepinfer"


def cache_dir() -> Path:
    return cache_root() / "cpu_native"


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _owner(uid: int) -> str:
    try:
        import pwd
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _unwritable(path: Path, exc: OSError) -> CacheError:
    return CacheError(f"cannot create or write the kernel cache directory {path}: {exc}. Fix: make it writable "
                      f"by you (e.g. `mkdir -p {path} && chmod 700 {path}`) or point DEEPINFER_CACHE_DIR at a "
                      f"directory you own")


def _unsafe(path: Path, st: os.stat_result, problem: str, fix: str) -> CacheError:
    return CacheError(f"refusing the kernel cache directory {path}: it {problem} (mode {stat.filemode(st.st_mode)} "
                      f"{stat.S_IMODE(st.st_mode):04o}, owner {_owner(st.st_uid)}; this process runs as "
                      f"{_owner(os.getuid())}), so someone else could plant a library there that this process "
                      f"would run. Fix: {fix}, or point DEEPINFER_CACHE_DIR at a directory only you can write")


def _check_directory(path: Path) -> None:
    """The library directory itself: a real directory (not a symlink), owned by this user, not
    writable by its group or by others."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _unsafe(path, st, "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory",
                      f"replace it with a directory of yours (`rm {path} && mkdir -m 700 {path}`)")
    if st.st_uid != os.getuid():
        raise _unsafe(path, st, "is not owned by you", f"remove it (`rm -r {path}`; it is rebuilt 0700) or "
                                                       f"`chown` it to yourself and `chmod 700 {path}`")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _unsafe(path, st, "is writable by " + ("others" if st.st_mode & stat.S_IWOTH else "its group"),
                      f"`chmod 700 {path}` (and delete the libraries in it if you did not build them)")


def _check_root(path: Path) -> None:
    """The folder above it (DEEPINFER_CACHE_DIR): whoever may rename its entries could swap the
    library directory, so it must belong to this user or root and not be writable by everyone
    unless sticky (as /tmp)."""
    st = os.stat(path)
    if st.st_uid not in (os.getuid(), 0):
        raise _unsafe(path, st, "is owned by another user", "use a directory of your own")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise _unsafe(path, st, "is writable by everyone (and not sticky)", f"`chmod o-w {path}` (or `chmod +t`)")


def _cache_directory() -> Path:
    """The library directory, created 0700 when missing, else checked (CacheError)."""
    root, path = cache_root(), cache_dir()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_root(root)
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # exactly 0700, whatever the umask
        except FileExistsError:
            pass
        _check_directory(path)
    except CacheError:
        raise
    except OSError as exc:
        raise _unwritable(path, exc) from exc
    return path


def _digest_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_atomically(target: Path, write) -> None:
    """`write(tmp_path)` fills a temporary file in target's directory, which then replaces target in
    one rename: readers see the old file or the complete new one."""
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o700 if target.suffix == ".so" else 0o600)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compile(target: Path, compiler: list[str], flags: tuple[str, ...] = FLAGS) -> str:
    """Compile to a temporary name next to `target`, record its sha256 in `<target>.sha256`, rename
    both into place; returns the digest. Processes building at the same time each produce complete
    files and the last rename wins."""
    digest = ""

    def build(tmp: str) -> None:
        nonlocal digest
        try:
            out = subprocess.run([*compiler, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                                 timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            raise CompilerError(f"running `{' '.join(compiler)}` failed: {exc}") from exc
        if out.returncode != 0:
            raise CompilerError((out.stderr or out.stdout).strip() or f"exit status {out.returncode}")
        with open(tmp, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()

    try:
        _write_atomically(target, build)
        _write_atomically(_digest_path(target), lambda tmp: Path(tmp).write_text(digest + "\n"))
    except OSError as exc:
        raise _unwritable(target.parent, exc) from exc
    return digest


def _read_digest(target: Path) -> str | None:
    """The sha256 recorded for `target`, or None when there is no (well-formed) record."""
    try:
        fd = os.open(_digest_path(target), os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        text = f.read(_DIGEST_FILE_MAX).decode("ascii", "replace").strip()
    return text.lower() if len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text) else None


def _open_verified(target: Path) -> tuple[int, bool]:
    """Open `target` (not through a symlink) and check it: a regular file of this user that its
    group and others cannot write, whose sha256 is the recorded one. Returns (fd, matches); the
    caller closes the fd. OSError when it cannot be opened."""
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            return fd, False
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        recorded = _read_digest(target)
        return fd, recorded is not None and hmac.compare_digest(h.hexdigest(), recorded)
    except BaseException:
        os.close(fd)
        raise


def _cpu_features() -> str:
    """What `-march=native` compiles for: the CPU's feature flags (Linux), else torch's ISA level. Part
    of the cache key, so a cache directory shared between different CPUs never hands one of them a
    library with instructions it lacks."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


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
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), version.stdout.encode(), " ".join(flags).encode(),
                                      " ".join(compiler).encode(), _cpu_features().encode()])).hexdigest()[:16]
    target = directory / f"kernels-{key}.so"
    try:
        fd, matches = _open_verified(target)
        os.close(fd)
    except FileNotFoundError:
        matches = None
    except OSError as exc:  # e.g. a symlink planted under the name (O_NOFOLLOW)
        logger.warning("deepinfer: cannot open the cached kernel library %s (%s); rebuilding it", target, exc)
        matches = False
    if matches is False:
        if _read_digest(target) is None:
            logger.info("deepinfer: the cached kernel library %s has no recorded sha256; rebuilding it", target)
        else:
            logger.warning("deepinfer: the cached kernel library %s does not match its recorded sha256 (or is not a "
                           "private file of yours); not loading it, rebuilding it", target)
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
    fd, matches = _open_verified(path)
    if not matches:
        os.close(fd)
        raise CacheError(f"refusing to load {path}: its contents do not match the sha256 recorded in "
                         f"{_digest_path(path)} (or it is not a private file of yours). Fix: delete both files so "
                         f"that the library is rebuilt, and check who can write {path.parent}")
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
    for name, argtypes in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.amx_usable.restype = ctypes.c_int
    lib.build_isa.restype = ctypes.c_int
    return lib


def amx_usable(lib: ctypes.CDLL) -> bool:
    """The library was built for a CPU with AMX and Linux granted this process the AMX state."""
    return bool(lib.amx_usable())


def build_isa(lib: ctypes.CDLL) -> frozenset[str]:
    """The instruction sets the library was compiled for (keys of ISA_BITS)."""
    bits = lib.build_isa()
    return frozenset(name for name, bit in ISA_BITS.items() if bits & bit)


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
                       "`apt-get install gcc`) or point $CC at one; %s", head, SOURCE, " ".join(_compiler()), exc,
                       silence)
    except CacheError as exc:
        logger.warning("%s %s; %s", head, exc, silence)
    except OSError as exc:
        logger.warning("%s Loading the library built from %s failed: %s. Fix: delete %s so that it is rebuilt; %s",
                       head, SOURCE, exc, cache_dir(), silence)
    return None


def active_library() -> ctypes.CDLL | None:
    """The library when enabled (DEEPINFER_CPU_NATIVE) and buildable, else None."""
    return library() if enabled() else None


# ----- tensor wrappers: None means "not handled here, use the reference kernel" -----
# Decode calls are a few microseconds, so the checks below use the cheapest tensor queries.

def _code(t: torch.Tensor) -> int | None:
    return _DTYPE_CODES.get(t.dtype) if t.is_cpu and not t.requires_grad else None


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.float32 and t.is_contiguous() else t.detach().float().contiguous()


def _new(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    dtype = _code(x)
    if dtype is None or x.dim() == 0 or x.numel() == 0:
        return None
    D = x.shape[-1]
    if weight is not None and (weight.shape != (D,) or _code(weight) is None):
        return None
    flat = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, D)  # a 2-D row view keeps its stride
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = _new(x)
    if weight is None:
        lib.rms_norm(flat.data_ptr(), flat.stride(0), None, 0, out.data_ptr(), flat.shape[0], D, eps, dtype,
                     torch.get_num_threads())
    else:
        w = weight.contiguous()
        lib.rms_norm(flat.data_ptr(), flat.stride(0), w.data_ptr(), _DTYPE_CODES[w.dtype], out.data_ptr(),
                     flat.shape[0], D, eps, dtype, torch.get_num_threads())
    return out


def rotary(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           inverse: bool) -> torch.Tensor | None:
    dtype = _code(x)
    if dtype is None or x.dim() < 2 or cos.dim() != 2 or cos.shape != sin.shape or not cos.is_cpu:
        return None
    T, half, d = x.shape[0], cos.shape[1], x.shape[-1]
    if cos.shape[0] != T or half == 0 or 2 * half > d or x.numel() == 0:
        return None  # broadcasting tables and odd shapes stay with the reference
    view = x.unsqueeze(1) if x.dim() == 2 else x.flatten(1, -2)  # [T, M, d], a view where possible
    if view.stride(-1) != 1:
        view = view.contiguous()
    c, s = _f32(cos), _f32(sin)
    out = _new(x)
    lib.rotary(view.data_ptr(), view.stride(0), view.stride(1), c.data_ptr(), s.data_ptr(), out.data_ptr(),
               T, view.shape[1], d, half, int(inverse), dtype, torch.get_num_threads())
    return out


def hc_pre(lib: ctypes.CDLL, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           sinkhorn_iters: int, eps: float, norm_eps: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    dtype = _code(streams)
    if dtype is None or streams.dim() != 3 or streams.numel() == 0:
        return None
    T, n, D = streams.shape
    mixes = n * (n + 2)
    if fn.shape != (mixes, n * D) or base.numel() != mixes or scale.numel() < 3:
        return None
    if not (fn.is_cpu and base.is_cpu and scale.is_cpu):
        return None
    s = streams.contiguous()
    f, b, sc = _f32(fn), _f32(base), _f32(scale)
    collapsed = torch.empty((T, D), dtype=streams.dtype)
    post = torch.empty((T, n), dtype=torch.float32)
    comb = torch.empty((T, n, n), dtype=torch.float32)
    lib.hc_pre(s.data_ptr(), f.data_ptr(), b.data_ptr(), sc.data_ptr(), collapsed.data_ptr(), post.data_ptr(),
               comb.data_ptr(), T, n, D, sinkhorn_iters, eps, norm_eps, dtype, torch.get_num_threads())
    return collapsed, post, comb


def hc_post(lib: ctypes.CDLL, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor | None:
    dtype, y_dtype = _code(streams), _code(y)
    if dtype is None or y_dtype is None or streams.dim() != 3 or streams.numel() == 0:
        return None
    T, n, D = streams.shape
    if y.shape != (T, D) or post.shape != (T, n) or comb.shape != (T, n, n) or not (post.is_cpu and comb.is_cpu):
        return None
    s, yc, p, c = streams.contiguous(), y.contiguous(), _f32(post), _f32(comb)
    out = _new(s)
    lib.hc_post(yc.data_ptr(), y_dtype, s.data_ptr(), p.data_ptr(), c.data_ptr(), out.data_ptr(), T, n, D, dtype,
                torch.get_num_threads())
    return out


def swiglu(lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor | None:
    dtype = _code(gate)
    if (dtype is None or gate.dtype != up.dtype or gate.shape != up.shape or gate.dim() != 2 or gate.numel() == 0
            or gate.stride(-1) != 1 or up.stride(-1) != 1 or gate.stride(0) != up.stride(0) or not up.is_cpu):
        return None  # e.g. separate gate and up tensors: the reference handles any layout
    out = torch.empty(gate.shape, dtype=gate.dtype)
    lib.swiglu(gate.data_ptr(), up.data_ptr(), gate.stride(0), out.data_ptr(), gate.shape[0], gate.shape[1], limit,
               dtype, torch.get_num_threads())
    return out


def gemv_bf16(lib: ctypes.CDLL, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """`weight @ x` for one bf16 token (x `[K]` or `[1, K]`), or None for anything else."""
    if (weight.dtype is not torch.bfloat16 or x.dtype is not torch.bfloat16 or weight.dim() != 2
            or x.numel() != weight.shape[1] or not (weight.is_cpu and x.is_cpu) or not weight.is_contiguous()
            or weight.requires_grad or x.requires_grad):
        return None
    xc = x.reshape(-1)
    if xc.stride(0) != 1:
        xc = xc.contiguous()
    out = torch.empty(weight.shape[0], dtype=torch.bfloat16)
    lib.gemv_bf16(weight.data_ptr(), xc.data_ptr(), out.data_ptr(), weight.shape[0], weight.shape[1],
                  torch.get_num_threads())
    return out


def experts_bf16(lib: ctypes.CDLL, rows: torch.Tensor, tokens_per_expert: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, limit: float) -> torch.Tensor | None:
    """The routed experts of rows grouped by expert (`rows [n, D]`, `w13 [E, 2I, D]`, `w2 [E, D, I]`,
    bf16), or None for anything else."""
    E = w13.shape[0] if w13.dim() == 3 else -1
    if (any(t.dtype is not torch.bfloat16 or not t.is_cpu or t.requires_grad or not t.is_contiguous()
            for t in (rows, w13, w2)) or rows.dim() != 2 or w2.dim() != 3 or E < 1
            or w13.shape[2] != rows.shape[1] or w13.shape[1] % 2 or w2.shape != (E, rows.shape[1], w13.shape[1] // 2)
            or tokens_per_expert.shape != (E,)):
        return None
    n, D = rows.shape
    inter = w2.shape[2]
    offsets = torch.zeros(E + 1, dtype=torch.long)
    torch.cumsum(tokens_per_expert.to(torch.long), 0, out=offsets[1:])
    if int(offsets[-1]) != n:
        return None
    gate_up = torch.empty((n, 2 * inter), dtype=torch.bfloat16)
    hidden = torch.empty((n, inter), dtype=torch.bfloat16)
    out = torch.empty((n, D), dtype=torch.bfloat16)
    lib.experts_bf16(rows.data_ptr(), n, D, offsets.data_ptr(), E, w13.data_ptr(), w2.data_ptr(), inter, limit,
                     gate_up.data_ptr(), hidden.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def argmax_logsumexp(lib: ctypes.CDLL, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of fp32 logits `[L, V]`: first maximal index and log-sum-exp, or None for other input."""
    if (logits.dtype is not torch.float32 or logits.dim() != 2 or not logits.is_cpu or logits.requires_grad
            or logits.shape[1] == 0 or logits.stride(1) != 1):
        return None
    L, V = logits.shape
    index = torch.empty(L, dtype=torch.long)
    log_norm = torch.empty(L, dtype=torch.float32)
    lib.argmax_logsumexp(logits.data_ptr(), L, V, logits.stride(0), index.data_ptr(), log_norm.data_ptr(),
                         torch.get_num_threads())
    odd = ~torch.isfinite(log_norm)
    if odd.any():  # an infinite or NaN maximum (or an overflowing sum): torch's semantics for those rows
        rows = odd.nonzero().squeeze(1)
        index[rows] = logits[rows].max(dim=-1).indices
        log_norm[rows] = torch.logsumexp(logits[rows], dim=-1)
    return index, log_norm


def grouped_gemv_bf16(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """One bf16 token's grouped projection: x `[1, G, K]`, weight `[G, N, K]` -> `[1, G, N]`; else None."""
    if (x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.dim() != 3 or weight.dim() != 3
            or x.shape[0] != 1 or x.shape[1:] != (weight.shape[0], weight.shape[2]) or not (x.is_cpu and weight.is_cpu)
            or not weight.is_contiguous() or x.requires_grad or weight.requires_grad):
        return None
    G, N, K = weight.shape
    xc = x.contiguous()
    out = torch.empty((1, G, N), dtype=torch.bfloat16)
    lib.grouped_gemv_bf16(weight.data_ptr(), xc.data_ptr(), out.data_ptr(), G, N, K, torch.get_num_threads())
    return out


def moe_dispatch_rows(lib: ctypes.CDLL, x: torch.Tensor, ids: torch.Tensor, num_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, tokens_per_expert, source_token, source_slot) of the stable grouping by expert, or None
    (unsupported input, or an id outside [0, num_experts): the reference reports it)."""
    if (_code(x) is None or x.dim() != 2 or not x.is_contiguous() or ids.dim() != 2 or ids.shape[0] != x.shape[0]
            or not ids.is_cpu or ids.dtype not in (torch.int64, torch.int32)):
        return None
    T, k = ids.shape
    flat = ids.to(torch.int64).contiguous()
    counts = torch.empty(num_experts, dtype=torch.int64)
    source_token, source_slot = torch.empty(T * k, dtype=torch.int64), torch.empty(T * k, dtype=torch.int64)
    rows = torch.empty((T * k, x.shape[1]), dtype=x.dtype)
    status = torch.zeros(1, dtype=torch.int32)
    lib.moe_dispatch_rows(flat.data_ptr(), T, k, num_experts, x.data_ptr(), x.shape[1] * x.element_size(),
                          counts.data_ptr(), source_token.data_ptr(), source_slot.data_ptr(), rows.data_ptr(),
                          status.data_ptr(), torch.get_num_threads())
    return None if status.item() else (rows, counts, source_token, source_slot)


def moe_combine_rows(lib: ctypes.CDLL, rows: torch.Tensor, source_token: torch.Tensor, source_slot: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor | None:
    """`[T, D]` fp32: each token's k expert rows weighted by `weights [T, k]`, or None when the rows are
    not exactly one per (token, choice) or the input is unsupported."""
    dtype = _code(rows)
    if (dtype is None or rows.dim() != 2 or not rows.is_contiguous() or weights.dim() != 2
            or rows.shape[0] != weights.numel() or source_token.shape != (rows.shape[0],)
            or source_slot.shape != (rows.shape[0],) or not (source_token.is_cpu and source_slot.is_cpu)):
        return None
    T, k = weights.shape
    w = _f32(weights)
    st, ss = source_token.to(torch.int64).contiguous(), source_slot.to(torch.int64).contiguous()
    out = torch.empty((T, rows.shape[1]), dtype=torch.float32)
    status = torch.zeros(1, dtype=torch.int32)
    lib.moe_combine_rows(rows.data_ptr(), dtype, rows.shape[1], st.data_ptr(), ss.data_ptr(), T, k, w.data_ptr(),
                         out.data_ptr(), status.data_ptr(), torch.get_num_threads())
    return None if status.item() else out


def sink_attention_decode(lib: ctypes.CDLL, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
                          sinks: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Sink attention of `q [B, S, H, d]` over `kv [B, L, d]` (see the interface), or None for input
    the C code does not handle."""
    dtype = _code(q)
    if (dtype is None or q.dim() != 4 or kv.dim() != 3 or kv.dtype != q.dtype or not kv.is_cpu
            or kv.shape[0] != q.shape[0] or kv.shape[2] != q.shape[3] or mask.shape != (q.shape[0], q.shape[1], kv.shape[1])
            or mask.dtype != torch.bool or sinks.shape != (q.shape[2],)):
        return None
    B, S, H, d = q.shape
    qc, kvc, m = q.contiguous(), kv.contiguous(), mask.contiguous()
    out = torch.empty((B, S, H, d), dtype=q.dtype)
    lib.sink_attention_decode(qc.data_ptr(), kvc.data_ptr(), m.data_ptr(), _f32(sinks).data_ptr(), scale,
                              out.data_ptr(), B, S, H, kv.shape[1], d, dtype, torch.get_num_threads())
    return out


def grouped_amx_bf16(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """A few tokens' grouped projection on AMX tiles: x `[T, G, K]`, weight `[G, N, K]` -> `[T, G, N]`;
    None without AMX or for shapes the tiles do not cover."""
    if (x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.dim() != 3 or weight.dim() != 3
            or x.shape[1:] != (weight.shape[0], weight.shape[2]) or not (x.is_cpu and weight.is_cpu)
            or not weight.is_contiguous() or x.requires_grad or weight.requires_grad
            or weight.shape[1] % 64 or weight.shape[2] % 32 or not amx_usable(lib)):
        return None
    T, G, K = x.shape
    N = weight.shape[1]
    xg = x.transpose(0, 1).contiguous()  # [G, T, K]: each group's tokens together
    out = torch.empty((G, T, N), dtype=torch.bfloat16)
    lib.grouped_amx_bf16(weight.data_ptr(), G, N, K, xg.data_ptr(), T, out.data_ptr(), torch.get_num_threads())
    return out.transpose(0, 1)


def linear_amx_bf16(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`x [m, K] @ weight [N, K]^T` on AMX tiles (`grouped_amx_bf16` with one group), or None without
    AMX or for shapes they do not cover."""
    if (x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.dim() != 2 or weight.dim() != 2
            or x.shape[1] != weight.shape[1] or not (x.is_cpu and weight.is_cpu) or not weight.is_contiguous()
            or x.requires_grad or weight.requires_grad or weight.shape[0] % 64 or weight.shape[1] % 32
            or not amx_usable(lib)):
        return None
    xc = x.contiguous()
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    lib.grouped_amx_bf16(weight.data_ptr(), 1, weight.shape[0], weight.shape[1], xc.data_ptr(), x.shape[0],
                         out.data_ptr(), torch.get_num_threads())
    return out
