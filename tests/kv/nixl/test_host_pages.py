"""Host buffers on huge pages (kv/nixl/host_pages.py): aligned, zeroed, and on huge pages where the
kernel gives them on request."""

from __future__ import annotations

import os

import pytest
import torch

from kv.nixl.host_pages import HUGE_PAGE, huge_page_zeros
from tests.huge_pages import huge_kib_at, smaps_kib_at, thp_mode


def test_buffer_is_zeroed_aligned_and_writable():
    dirty = torch.full((8 << 20,), 7, dtype=torch.uint8)  # leave garbage for the allocator to reuse
    del dirty
    buf = huge_page_zeros(5, 3 << 20)
    assert buf.shape == (5, 3 << 20) and buf.dtype == torch.uint8
    assert buf.data_ptr() % HUGE_PAGE == 0 and buf.is_contiguous()
    assert int(buf.count_nonzero()) == 0
    buf[4, -1] = 9
    assert int(buf.sum()) == 9


def test_buffer_is_resident_before_its_first_use():
    """Every page is faulted in when the buffer is made: not by the first requests that use it."""
    buf = huge_page_zeros(6, 1 << 20)
    assert smaps_kib_at(os.getpid(), buf.data_ptr(), "Rss") >= 6 * 1024


@pytest.mark.skipif(thp_mode() != "madvise", reason="huge pages only on request (THP 'madvise') show the request")
def test_buffer_sits_on_huge_pages():
    buf = huge_page_zeros(4, 4 << 20)
    assert huge_kib_at(os.getpid(), buf.data_ptr()) >= 4 * 4 * 1024
    plain = torch.ones(4, 4 << 20, dtype=torch.uint8)
    assert huge_kib_at(os.getpid(), plain.data_ptr()) == 0  # what the request changes
