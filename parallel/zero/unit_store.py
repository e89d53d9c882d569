"""Where an offloaded ZeRO-3 unit's state lives between uses: files or host memory.

A unit's *record* is this rank's shard of it as the optimizer sees it: the fp32 master
values, then each optimizer state tensor (Adam's ``exp_avg``, ``exp_avg_sq``), each
padded to a whole 4 KiB block. The master comes first, so a forward, which needs only
the values, reads the first block range alone; a backward reads the whole record (its
step needs the state too) and writes it back after the step.

:class:`FileUnitStore` keeps one file per rank, every unit at a fixed offset. It reads and
writes with ``O_DIRECT`` into page-aligned buffers (anonymous ``mmap``), so the page cache
holds none of it and the memory a cap measures is only what is in use; where the file
system refuses ``O_DIRECT`` it writes, ``fdatasync``\\ s, and drops the pages with
``posix_fadvise(POSIX_FADV_DONTNEED)`` instead. :class:`HostUnitStore` keeps the records in
host memory (pinned when CUDA exists; the copy to a GPU goes through the record's
host buffer on an I/O thread, so it is off the compute thread but not yet a direct
asynchronous copy: that path has not run on a GPU) and copies
them into the same buffers: the pipeline above is one code for both.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 4096  # O_DIRECT's alignment of offsets, lengths and buffer addresses


def _padded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one unit's record: ``fields`` tensors of ``numel`` elements each."""

    numel: int
    dtype: torch.dtype
    fields: tuple[str, ...]  # "master" first

    @property
    def field_bytes(self) -> int:
        return _padded(self.numel * self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.field_bytes * len(self.fields)


class Record:
    """A page-aligned buffer holding a unit's record (or its master alone), and tensor
    views of its fields."""

    def __init__(self, layout: RecordLayout, device: torch.device):
        self.layout = layout
        # page-aligned (O_DIRECT can use it), private: a forgotten field's pages are freed
        self._map = mmap.mmap(-1, layout.nbytes, flags=mmap.MAP_PRIVATE)
        self.host = torch.frombuffer(self._map, dtype=torch.uint8)
        # ``device`` is where the unit computes; on a CPU it is the host buffer itself
        self.data = self.host if device.type == "cpu" else torch.empty(
            layout.nbytes, dtype=torch.uint8, device=device)
        self.loaded: frozenset[str] = frozenset()  # which fields hold the unit's values

    def field(self, name: str) -> torch.Tensor:
        k = self.layout.fields.index(name)
        size = self.layout.field_bytes
        raw = self.data[k * size : (k + 1) * size]
        return raw.view(self.layout.dtype)[: self.layout.numel]

    def bounds(self, first: int, count: int) -> tuple[int, int]:
        """Byte range of fields ``first`` to ``first + count``."""
        size = self.layout.field_bytes
        return first * size, (first + count) * size

    def to_device(self, first: int, count: int) -> None:
        """After a read: the host bytes onto the unit's device (nothing on a CPU)."""
        if self.data is not self.host:
            lo, hi = self.bounds(first, count)
            self.data[lo:hi].copy_(self.host[lo:hi])

    def to_host(self, first: int, count: int) -> None:
        """Before a write: the device's bytes into the host buffer (nothing on a CPU)."""
        if self.data is not self.host:
            lo, hi = self.bounds(first, count)
            self.host[lo:hi].copy_(self.data[lo:hi])

    def forget(self, keep: tuple[str, ...]) -> None:
        """Give the pages of every field but ``keep`` back to the system (a record
        waiting to be written holds only what is written)."""
        if self.data is not self.host or not hasattr(mmap, "MADV_DONTNEED"):
            return  # on a GPU the host buffer is only a staging copy
        for k, name in enumerate(self.layout.fields):
            if name not in keep:
                lo, hi = self.bounds(k, 1)
                self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        self.loaded = self.loaded & frozenset(keep)

    def release(self) -> None:
        """Let the host buffer go (the record is not used again): it is unmapped once
        no view of a field is left (a gather or a step may still hold one briefly)."""
        self.host = self.data = torch.empty(0, dtype=torch.uint8)
        self._map = None  # type: ignore[assignment]

    def span(self, first: int, count: int) -> memoryview:
        """Fields ``first`` to ``first + count`` of the host buffer, as bytes for the file
        calls."""
        lo, hi = self.bounds(first, count)
        return memoryview(self._map)[lo:hi]


class FileUnitStore:
    """Every unit's record in one file per rank (``<directory>/rank<r>.state``), unlinked
    as soon as it is open: it takes disk space while the rank holds it, and no file is
    left behind, not even by a rank that is killed.

    Args:
        directory: where the file is made (and made if missing).
        rank: this rank (in the data-parallel group).
        layouts: each unit's record layout, in unit order.
    """

    def __init__(self, directory: str, rank: int, layouts: Sequence[RecordLayout]):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank{rank}.state")
        self.offsets, at = [], 0
        for layout in layouts:
            self.offsets.append(at)
            at += layout.nbytes
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        try:
            self._fd = os.open(self.path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError:  # tmpfs and some others refuse O_DIRECT
            self._fd = os.open(self.path, flags, 0o600)
            self.direct = False
        os.ftruncate(self._fd, at)
        os.unlink(self.path)
        self.size = at
        self.bytes_read = self.bytes_written = 0
        self._mapped: mmap.mmap | None = None
        self._whole = torch.empty(0, dtype=torch.uint8)  # the mapping, as bytes

    def field_view(self, k: int, layout: RecordLayout, field: int) -> torch.Tensor:
        """Unit ``k``'s field ``field`` as a tensor over the file itself (a shared
        mapping: pages come in as they are touched and go back once clean, so a
        checkpoint streams through it without holding the records). Between
        :meth:`end_views` calls only; no record I/O may run meanwhile."""
        if self._mapped is None:
            self._mapped = mmap.mmap(self._fd, self.size)
            self._whole = torch.frombuffer(self._mapped, dtype=torch.uint8)
        lo = self.offsets[k] + field * layout.field_bytes
        return self._whole[lo : lo + layout.field_bytes].view(layout.dtype)[: layout.numel]

    def release_view(self, view: torch.Tensor, written: bool) -> None:
        """The pages under ``view`` (a part of a :meth:`field_view`) leave this process
        and the page cache, written to the file first when ``written``."""
        if self._mapped is None:
            return
        start = view.data_ptr() - self._whole.data_ptr()
        if not 0 <= start <= self.size - view.nbytes:
            return  # not the store's (a master kept in memory)
        lo = start // mmap.PAGESIZE * mmap.PAGESIZE
        hi = min(self.size, -(-(start + view.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        if written:
            self._mapped.flush(lo, hi - lo)
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mapped.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def end_views(self) -> None:
        """Write what the views changed to the file and drop their pages, so record I/O
        (which bypasses the page cache) sees it; the views must be dropped first."""
        if self._mapped is None:
            return
        self._mapped.flush()
        self._whole = torch.empty(0, dtype=torch.uint8)
        mapped, self._mapped = self._mapped, None
        with contextlib.suppress(BufferError):  # a view is still alive: unmapped with it
            mapped.close()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, self.size, os.POSIX_FADV_DONTNEED)

    def read(self, k: int, record: Record, first: int, count: int) -> None:
        """Unit ``k``'s fields ``first`` to ``first + count`` into ``record`` (blocking:
        run it on an I/O thread)."""
        view = record.span(first, count)
        offset = self.offsets[k] + record.bounds(first, count)[0]
        done = 0
        while done < len(view):
            done += os.preadv(self._fd, [view[done:]], offset + done)
        self._drop_cache(offset, len(view))
        self.bytes_read += len(view)

    def write(self, k: int, record: Record, first: int, count: int) -> None:
        """``record``'s fields ``first`` to ``first + count`` as unit ``k``'s (blocking)."""
        view = record.span(first, count)
        offset = self.offsets[k] + record.bounds(first, count)[0]
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        if not self.direct:
            os.fdatasync(self._fd)  # dirty pages cannot be dropped before they are written
        self._drop_cache(offset, len(view))
        self.bytes_written += len(view)

    def _drop_cache(self, offset: int, length: int) -> None:
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        os.close(self._fd)


class HostUnitStore:
    """Every unit's record in host memory (pinned where CUDA exists)."""

    def __init__(self, layouts: Sequence[RecordLayout]):
        pin = torch.cuda.is_available()
        self._host = [torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
                      for layout in layouts]
        self.bytes_read = self.bytes_written = 0

    def read(self, k: int, record: Record, first: int, count: int) -> None:
        lo, hi = record.bounds(first, count)
        record.host[lo:hi].copy_(self._host[k][lo:hi])
        self.bytes_read += hi - lo

    def write(self, k: int, record: Record, first: int, count: int) -> None:
        lo, hi = record.bounds(first, count)
        self._host[k][lo:hi].copy_(record.host[lo:hi])
        self.bytes_written += hi - lo

    def field_view(self, k: int, layout: RecordLayout, field: int) -> torch.Tensor:
        """Unit ``k``'s field ``field``, a view of the stored record."""
        lo = field * layout.field_bytes
        return self._host[k][lo : lo + layout.field_bytes].view(layout.dtype)[: layout.numel]

    def release_view(self, view: torch.Tensor, written: bool) -> None:
        """(The views are host memory: nothing to let go.)"""

    def end_views(self) -> None:
        """(The views are the records themselves.)"""

    def close(self) -> None:
        self._host.clear()
