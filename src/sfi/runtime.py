"""Process-wide memory settings: :func:`keep_freed_memory`, which sfi's own commands make for
speed (a library import changes nothing; call it yourself in a program of your own), and
:func:`give_back_freed_memory`, which the server calls after a join.

On Linux with glibc, ``malloc`` hands every allocation above a threshold (at most 32 MB, and
128 KB until a large block is freed) to ``mmap`` and gives it back to the system when freed, so
a decode loop that makes and frees the same large tensors every step pays a page fault per
4 KB page each time. In a virtual machine a fault is dear: a slow step of a 16K-token batch of 4
on this project's 2-core VM spends about half its time faulting unless freed memory is kept.
PyTorch's CPU tuning guide gives the same advice with another allocator (jemalloc or
TCMalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LARGEST = 2 ** 31 - 1  # mallopt takes an int
_OLD_GLIBC_LARGEST_MMAP = 32 * 2 ** 20  # glibc before 2.35 refuses a larger mmap threshold

ENV = "SFI_KEEP_FREED_MEMORY"


def _libc() -> ctypes.CDLL | None:
    """glibc (or the platform's C library), or None."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``). The server calls
    it after a prompt's prefill: every prompt is prefilled into its own cache, freed once
    copied into the slab, and every chunk's activations are freed too; glibc keeps what they
    freed, fragmented, and without this the server's resident memory only grows. No effect
    without glibc."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` serve large blocks from its heap and keep freed memory for reuse
    (up to 2 GB of free heap top) instead of returning it to the system. Blocks up to 2 GB come
    from the heap (glibc 2.35 and later; before, up to 32 MB, the most it accepts). Returns
    whether the setting took effect: False off Linux/glibc, or with ``SFI_KEEP_FREED_MEMORY=0``.
    The price: the process's resident memory stays near its peak."""
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap = mallopt(_M_MMAP_THRESHOLD, _LARGEST) or \
        mallopt(_M_MMAP_THRESHOLD, _OLD_GLIBC_LARGEST_MMAP)
    trim = mallopt(_M_TRIM_THRESHOLD, _LARGEST)
    return bool(mmap) and bool(trim)
