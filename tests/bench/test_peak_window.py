"""The bench's peak memory leaves out the harness's own allocations (accuracy comparisons): a
stand-in for the CUDA allocator's counters, so it runs on a CPU."""

from __future__ import annotations

import torch

from cgbackend.bench.measure import PeakWindow


class _Allocator:
    """torch.cuda's allocated / reserved counters and their peaks."""

    def __init__(self) -> None:
        self.now = self.peak = self.reserved = self.peak_reserved = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.reserved = max(self.reserved, self.now)
        self.peak, self.peak_reserved = max(self.peak, self.now), max(self.peak_reserved, self.reserved)

    def free(self, n: int) -> None:
        self.now -= n

    def reset(self, device=None) -> None:
        self.peak, self.peak_reserved = self.now, self.reserved


def _fake_cuda(monkeypatch) -> _Allocator:
    a = _Allocator()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: a.peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: a.peak_reserved)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset)
    return a


def test_the_peak_leaves_out_what_is_allocated_in_an_excluded_block(monkeypatch):
    a = _fake_cuda(monkeypatch)
    window = PeakWindow(torch.device("cuda"))
    a.alloc(100)  # a contender's step: 100 at its peak, 40 held after
    a.free(60)
    with window.excluded():  # comparisons: 500 more for a moment
        a.alloc(500)
        a.free(500)
    assert window.peaks() == (100, 540)  # reserved memory the comparisons grew stays reserved
    a.alloc(80)  # the next step goes higher than the first: 120
    a.free(80)
    with window.excluded():
        a.alloc(500)
        a.free(500)
    assert window.peaks()[0] == 120
    a.alloc(10)  # after the last excluded block the counter runs on
    assert window.peaks()[0] == 120


def test_without_cuda_nothing_is_read(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("no CUDA counter is read for a CPU device")

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fail)
    with PeakWindow(torch.device("cpu")).excluded():
        pass
