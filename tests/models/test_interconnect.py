"""The GPU-to-GPU link table: every entry names a catalogue GPU, is sourced and positive; a GPU without one is an error."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvsim.errors import KvsimError
from kvsim.models.hardware import get_gpu, gpu_names
from kvsim.models.interconnect import get_interconnect, interconnects


def test_every_entry_is_a_catalogue_gpu_with_a_sourced_bandwidth():
    table = interconnects()
    assert table and set(table) <= set(gpu_names())
    for key, link in table.items():
        assert link.bandwidth_bytes_per_s > 0 and "http" in link.source, key


def test_datasheet_figures_are_one_direction():
    # NVLink 4 on H100 SXM: 900 GB/s both directions, 450 GB/s each way; L40S: PCIe Gen4 x16, 64 GB/s both ways.
    assert get_interconnect(get_gpu("h100-80gb")).bandwidth_bytes_per_s == 450e9
    assert get_interconnect(get_gpu("l40s")).bandwidth_bytes_per_s == 32e9


def test_a_gpu_without_a_link_is_a_one_line_error():
    gpu = replace(get_gpu("h100-80gb"), key="no-such-gpu", name="Mystery GPU")
    with pytest.raises(KvsimError, match="Mystery GPU: no GPU-to-GPU link bandwidth in kvsim/models/data/interconnect.yaml"):
        get_interconnect(gpu)
