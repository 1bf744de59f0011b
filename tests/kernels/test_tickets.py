"""The split kernels' arrival counters (`atom_kernels.tickets`)."""

from __future__ import annotations

import torch

from atom_kernels import tickets


def test_counters_are_zeroed_shared_and_grow_without_freeing(monkeypatch):
    monkeypatch.setattr(tickets, "_counters", {})
    monkeypatch.setattr(tickets, "_outgrown", [])
    cpu = torch.device("cpu")
    first = tickets.ticket_counters(cpu, 10)
    assert first.dtype == torch.int32 and first.numel() >= tickets._INITIAL_SIZE
    assert not first.any()
    assert tickets.ticket_counters(cpu, 100).data_ptr() == first.data_ptr()  # one buffer
    bigger = tickets.ticket_counters(cpu, tickets._INITIAL_SIZE + 1)
    assert bigger.numel() >= tickets._INITIAL_SIZE + 1 and not bigger.any()
    # The outgrown buffer stays allocated: graphs captured with it still point into it.
    assert tickets._outgrown == [first]
    assert tickets.ticket_counters(cpu, 5).data_ptr() == bigger.data_ptr()
