"""Facts about the machine this process runs on: the cores it may use and the CPU's name; handing the C
heap's free memory back to it (and having large temporaries bypass the heap while kernels are timed), letting go
of pages read from files this process maps, and packing small weights onto huge pages (:class:`WeightArena`).

Standard library only, and nothing of the daemon: the config, the model code and the bench all
read these, so they live below every layer.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
from collections.abc import Iterator


def host_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_name() -> str:
    """This host's CPU model as the kernel names it (``/proc/cpuinfo``), else what Python knows of it."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere). A freed
    tensor of a few MiB stays in glibc's heap, where a new one of the same size does not fit (it asks for
    alignment on top): a node laying out or fusing its weights anew would otherwise peak well above them."""
    if LIBC is not None:
        LIBC.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # mallopt's parameter in glibc's malloc.h
MAPPED_THRESHOLD = 1 << 20  # allocations this large or larger are mapped on their own
_MMAP_THRESHOLD_MAX = 32 << 20  # where glibc's own sliding threshold stops on a 64-bit host


@contextlib.contextmanager
def large_allocations_mapped(threshold: int = MAPPED_THRESHOLD) -> Iterator[None]:
    """For the ``with`` block, glibc maps every allocation of ``threshold`` bytes or more on its own and hands it
    back to the system when it is freed; afterwards those below 32 MiB come from its heap again (where glibc's
    sliding threshold settles once a large block was freed, as timing kernels frees many), and the heap is trimmed.

    Timing a node's kernels frees hundreds of samples and copies of 1-32 MiB. Carved from the heap, freed ones
    stayed resident, holes the next did not fit: a 4-layer Llama-8B-shaped node quantized to 4 bits peaked at
    1286 MiB measuring its plans (1149 MiB reading them), 1137 MiB with them mapped (its weights 1044 MiB). Not
    around the whole load: a quantizer's chunks, each of the same size, reuse their hole, and mapped anew each
    would fault in fresh pages (the built-in model's 4-bit load took 2.6-2.8 s against 2.0-2.2). Nothing where the
    C library is not glibc."""
    mallopt = getattr(LIBC, "mallopt", None) if LIBC is not None else None
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, threshold):
        yield
        return
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        return_freed_memory()


TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # torch's own switch, read at its first allocation of 2 MiB or more


def prefer_huge_pages() -> None:
    """Have torch back its allocations of 2 MiB and more (a node's weights) with transparent huge pages, unless
    the environment already says (``THP_MEM_ALLOC_ENABLE=0`` turns it off). Torch then aligns them to 2 MiB and
    asks the kernel for huge pages there (``madvise(MADV_HUGEPAGE)``, which the usual ``madvise`` setting of
    ``/sys/kernel/mm/transparent_hugepage/enabled`` honours): streaming weights then walks a page table entry per
    2 MiB, not per 4 KiB. Call it before torch allocates anything that large; it changes no arithmetic."""
    os.environ.setdefault(TORCH_HUGE_PAGES, "1")


def huge_pages_preferred() -> bool:
    """Whether torch backs this process's large allocations with huge pages (:func:`prefer_huge_pages`, or the
    user's own ``THP_MEM_ALLOC_ENABLE``): weights are then worth copying out of a checkpoint's file mapping."""
    return os.environ.get(TORCH_HUGE_PAGES, "").strip().lower() in ("1", "on", "yes", "true", "y")


def file_mappings() -> list[tuple[int, int]]:
    """This process's memory ranges mapped from files (checkpoints whose pages a node's weights were read from)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        pass
    return ranges


def in_file_mapping(start: int, length: int, mappings: list[tuple[int, int]]) -> bool:
    """Whether the ``length`` bytes at address ``start`` lie in one of ``mappings``."""
    return any(lo <= start and start + length <= hi for lo, hi in mappings)


def release_file_pages(start: int, length: int, mappings: list[tuple[int, int]]) -> None:
    """Drop the resident pages of the ``length`` bytes at ``start`` where they lie in a file mapping: a weight
    copied out of a checkpoint no longer reads them, and they would count in the node's memory beside the copy
    until the mapping goes. Only whole pages inside the range, only file pages: touched again, they are read back
    from the file. Anonymous memory (a cast, a copy) is left alone: it is freed with its last reference."""
    if LIBC is None or length <= 0 or not in_file_mapping(start, length, mappings):
        return
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, (start + length) // page * page
    if last > first:
        LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def release_tensor_pages(tensor, mappings: list[tuple[int, int]]) -> None:
    """:func:`release_file_pages` for the memory of ``tensor`` (a torch tensor), where it is one range of memory
    (contiguous); the pages under a strided view are left alone."""
    if tensor.is_contiguous():
        release_file_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size(), mappings)


def copy_out_of_file(source, target, mappings: list[tuple[int, int]], *, block_bytes: int) -> None:
    """Copy torch tensor ``source`` into ``target`` (same shape, any strides) ``block_bytes`` of leading rows at a
    time, letting go of each block's file pages (:func:`release_tensor_pages`) once copied: the resident set holds
    a weight read from a checkpoint twice for one block at most, not whole."""
    if source.dim() == 0:
        target.copy_(source)
        return
    rows = max(1, block_bytes // (source[0].numel() * source.element_size() or 1))
    for first in range(0, source.shape[0], rows):
        part = source[first:first + rows]
        target[first:first + rows].copy_(part)
        release_tensor_pages(part, mappings)


_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
WEIGHT_ALIGN = 64  # a cache line: where each weight in an arena begins


class WeightArena:
    """Small weights, packed side by side into chunks of memory on transparent huge pages.

    torch puts an allocation of 2 MiB and more on huge pages (:func:`prefer_huge_pages`), but a 3.4 MiB matrix then
    covers one huge page and a part, and weights under 2 MiB (most of an int8 or 4-bit layer's, every norm) none:
    streamed through 4 KiB pages, each page is a TLB miss at every step. Packed here, every 2 MiB of them is one huge
    page. A chunk's pages are faulted in as its weights are written: what it has not handed out is not resident, and
    a part-filled chunk holds one huge page more than its weights at most. A weight of ``largest`` bytes and more
    keeps an allocation of its own: its part-filled last huge page is a small share of it, and a second copy of a
    large quantized weight would raise a node's peak at load.
    """

    CHUNK = 64 << 20
    LARGEST = 8 << 20

    def __init__(self, chunk_bytes: int = CHUNK, largest: int = LARGEST) -> None:
        self.chunk_bytes = chunk_bytes
        self.largest = min(largest, chunk_bytes)
        self._chunk = None  # the chunk being filled (a uint8 torch tensor), and how far
        self._used = 0
        self._storages: set[int] = set()  # the chunks' storages, by address

    def takes(self, tensor) -> bool:
        """Whether ``tensor`` belongs here: one contiguous range on the CPU, smaller than ``largest``."""
        nbytes = tensor.numel() * tensor.element_size()
        return tensor.device.type == "cpu" and tensor.is_contiguous() and 0 < nbytes < self.largest

    def holds(self, tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._storages

    def empty_like(self, tensor):
        """Room for a copy of ``tensor`` (one the arena :meth:`takes`): an uninitialised view of a chunk."""
        nbytes = tensor.numel() * tensor.element_size()
        start = -(-self._used // WEIGHT_ALIGN) * WEIGHT_ALIGN
        if self._chunk is None or start + nbytes > self.chunk_bytes:
            self._chunk, start = self._new_chunk(), 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes].view(tensor.dtype).view(tensor.shape)

    def _new_chunk(self):
        import torch

        raw = torch.empty(self.chunk_bytes + HUGE_PAGE, dtype=torch.uint8)  # room to begin on a huge page's boundary
        skip = -raw.data_ptr() % HUGE_PAGE  # the bytes before it are never touched, so never resident
        chunk = raw[skip:skip + self.chunk_bytes]
        if LIBC is not None:  # torch asks this itself where it aligns the allocation (THP_MEM_ALLOC_ENABLE)
            LIBC.madvise(ctypes.c_void_p(chunk.data_ptr()), ctypes.c_size_t(self.chunk_bytes), _MADV_HUGEPAGE)
        self._storages.add(chunk.untyped_storage().data_ptr())
        return chunk


def _load_libc():
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        if hasattr(libc, "mallopt"):
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):  # not glibc: nothing to trim, nothing lost
        return None


LIBC = _load_libc()  # the C library (glibc's malloc_trim, madvise), or None where it cannot be had


def proc_status_bytes(*fields: str) -> dict[str, int | None]:
    """``kB`` lines of /proc/self/status in bytes, from one reading (``VmHWM``: the peak resident set); None for a
    field there is none of."""
    found: dict[str, int | None] = dict.fromkeys(fields)
    try:
        with open("/proc/self/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in found:
                    found[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found
