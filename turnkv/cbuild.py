"""Build and load turnkv's C kernels (``attention/cpu_attention.c``, ``models/cpu_int4.c``).

Each is compiled at first use with ``$CC`` (default ``cc``), ``-O3 -march=native -fopenmp``
(without ``-fopenmp`` where that fails: one thread), into ``$XDG_CACHE_HOME/turnkv/kernels`` (or
``~/.cache/turnkv/kernels``), named by a hash of the source, the flags and this CPU's feature
flags, written under a temporary name and renamed, so concurrent processes never load a
half-written file. ``TURNKV_CPU_KERNEL=off`` keeps every C kernel off (their torch paths run;
the tests and benches use it to run both). ``TURNKV_CPU_ISA`` picks the variant the kernels compile:
``native`` (default: this CPU's widest), ``avx2`` (no AVX-512: an AVX2 laptop's build) or ``plain``
(no AVX2: plain C vectors); a variant this CPU cannot run is refused with the reason. Every variant
gives the same bits (the tests check it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-shared", "-fPIC")
# -fopenmp links libgomp.so.1, which the loader resolves to the copy torch already loaded (same
# soname): a kernel's parallel loops run on torch's thread team, awake from the last op. Work
# split over a Python pool instead contended with that team's spinning threads, slower than one
# thread (docs/BENCHMARKS.md, 'CPU decode attention in C').
OPENMP = ("-fopenmp",)
# the variants: the extra flag of each, and the CPU flag it needs (``isa_flags``)
ISAS = {"native": (), "avx2": ("-mno-avx512f",), "plain": ("-mno-avx2",)}


def isa() -> str:
    """The variant ``TURNKV_CPU_ISA`` asks for (``native`` unless set)."""
    name = os.environ.get("TURNKV_CPU_ISA", "native").lower()
    if name not in ISAS:
        raise RuntimeError(f"TURNKV_CPU_ISA={name!r}: not one of {', '.join(ISAS)}")
    return name


def isa_flags(name: str) -> tuple[str, ...]:
    """The compiler flags of variant ``name``; RuntimeError where this CPU cannot run it."""
    if name == "avx2" and "avx2" not in _cpu_flags().split():
        raise RuntimeError("TURNKV_CPU_ISA=avx2: this CPU has no AVX2 (use native or plain)")
    return ISAS[name]


def variant() -> str:
    """The variant the kernels run, in words for tables and /health: ``avx512-vnni``, ``avx2``,
    ``plain`` (what the compiler's ``-march=native`` less ``TURNKV_CPU_ISA``'s flag leaves)."""
    name, flags = isa(), set(_cpu_flags().split())
    if name == "native":
        if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
            return "avx512-vnni"
        return "avx2" if {"avx2", "fma", "f16c"} <= flags else "plain"
    return name


def switched_off() -> str | None:
    """The reason the C kernels are off by the environment, or None."""
    if os.environ.get("TURNKV_CPU_KERNEL", "auto").lower() in ("off", "0", "torch"):
        return "off (TURNKV_CPU_KERNEL)"
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/turnkv``, else ``~/.cache/turnkv``: where turnkv keeps what it derives."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "turnkv"


def _cache_dir() -> Path:
    return cache_home() / "kernels"


def build(source: Path, extra: tuple[str, ...] = ()) -> Path:
    """The shared library of ``source`` (``extra``: its own flags, after the common ones),
    compiled now or found in the cache; RuntimeError says why it cannot be (no compiler, a
    failed compile)."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
    src = source.read_bytes()
    flags = (*FLAGS, *isa_flags(isa()), *extra)
    key = hashlib.sha256(
        src + " ".join((cc, *flags, *OPENMP, platform.machine(), _cpu_flags())).encode()
    ).hexdigest()
    out = _cache_dir() / f"{source.stem}-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        for extra in (OPENMP, ()):
            run = subprocess.run([cc, *flags, *extra, str(source), "-o", tmp], capture_output=True, text=True)
            if not run.returncode:
                break
        else:
            raise RuntimeError(f"{cc} failed: {run.stderr.strip()[:400]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(source: Path, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``build`` then load; OSError or RuntimeError says why not."""
    return ctypes.CDLL(str(build(source, extra)))


class Kernel:
    """One C kernel of a module: built and loaded at the first ``library()`` call, or the reason
    it is not (its torch path runs then). ``setup`` declares the library's argument types;
    ``flags``: the source's own compiler flags."""

    def __init__(
        self, source: Path, setup: Callable[[ctypes.CDLL], None], fallback: str, flags: tuple[str, ...] = ()
    ):
        self.source, self.setup, self.fallback, self.flags = source, setup, fallback, flags
        self.lib: ctypes.CDLL | None = None
        self.why: str | None = None  # "ok", why not, or None before the first call
        self.loaded: ctypes.CDLL | None = None  # the library once loaded, whatever set_enabled says later

    def library(self) -> ctypes.CDLL | None:
        """The loaded kernel, or None (then ``status()`` is the reason). Built once per process."""
        if self.why is None:
            if off := switched_off():
                self.why = off
                return None
            try:
                lib = load(self.source, self.flags)
                self.setup(lib)
                self.lib, self.why, self.loaded = lib, "ok", lib
            except (OSError, RuntimeError, AttributeError) as e:
                self.why = f"{self.fallback} ({e})"
        return self.lib

    def set_enabled(self, on: bool) -> None:
        """Use the C kernel from now on (``on``: built or loaded now) or the torch path; the
        benches A/B the two in one process with it."""
        self.lib, self.why = None, (None if on else "off (set_enabled)")
        if on:
            self.library()

    def status(self) -> str:
        """``ok`` when the C kernel runs, else why the torch path does (``/health``)."""
        self.library()
        return self.why or "ok"
