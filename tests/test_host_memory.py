"""host_empty: host buffers for weights, 2 MiB-aligned and advised for transparent huge pages from 2 MiB up."""

from pathlib import Path

import pytest
import torch

from offload.runtime.backends.base import HUGE_PAGE_BYTES, host_empty
from offload.runtime.backends.cpu import CPUBackend


@pytest.mark.parametrize("n_bytes", [1, 4096, HUGE_PAGE_BYTES - 1, HUGE_PAGE_BYTES, 3 * HUGE_PAGE_BYTES + 123])
def test_size_alignment_and_use(n_bytes):
    buf = host_empty(n_bytes)
    assert buf.dtype == torch.uint8 and buf.numel() == n_bytes and buf.is_contiguous()
    if n_bytes >= HUGE_PAGE_BYTES:
        assert buf.data_ptr() % HUGE_PAGE_BYTES == 0
    buf.fill_(7)
    assert int(buf[-1]) == 7 and int(buf.sum()) == 7 * n_bytes


def test_backend_host_buffers_come_from_host_empty():
    buf = CPUBackend().alloc("cpu", 2 * HUGE_PAGE_BYTES)
    assert buf.data_ptr() % HUGE_PAGE_BYTES == 0


def _huge_kib_at(address: int) -> int | None:
    """AnonHugePages (KiB) of the mapping holding address, from /proc/self/smaps; None if unreadable."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def test_large_buffers_get_huge_pages_where_the_kernel_allows():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    buf = host_empty(8 * HUGE_PAGE_BYTES)
    buf.fill_(1)
    huge = _huge_kib_at(buf.data_ptr())
    if huge is None:
        pytest.skip("/proc/self/smaps not readable")
    assert huge >= 2048  # at least one 2 MiB page (the kernel may be short of free huge pages for the rest)
