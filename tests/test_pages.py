"""Served weights on huge pages: same values, own memory, advised where Linux can."""
import pathlib

import pytest
import torch
from conftest import make_checkpoint

from angelspec.checkpoint import read_config, read_weights
from angelspec.model import Llama
from angelspec.pages import HUGE_PAGE, LINE, huge_page_mb, on_huge_pages, zeros_on_huge_pages
from angelspec.plugins.linear import QuantWeight, quantize
from angelspec.weights import served_as

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_of(t: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding t's first byte."""
    at, fields, inside = t.data_ptr(), {}, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= at < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_zeros_lie_apart_on_lines_of_their_own_in_one_aligned_buffer():
    ts = zeros_on_huge_pages([((3, 5), torch.float32), ((7,), torch.int8), ((2, 2, 16), torch.bfloat16),
                              ((0,), torch.float16)])
    assert [tuple(t.shape) for t in ts] == [(3, 5), (7,), (2, 2, 16), (0,)]
    assert [t.dtype for t in ts] == [torch.float32, torch.int8, torch.bfloat16, torch.float16]
    assert all(t.is_contiguous() and not t.any() for t in ts)
    assert ts[0].data_ptr() % HUGE_PAGE == 0 and all(t.data_ptr() % LINE == 0 for t in ts)
    for t in ts[:3]:
        t.fill_(1)
    assert all(int(t.sum()) == t.numel() for t in ts[:3])  # no tensor overwrote another


def test_weights_keep_their_values_and_kinds():
    g = torch.Generator().manual_seed(0)
    w, q = torch.randn(16, 64, generator=g), quantize(torch.randn(32, 64, generator=g), "w4a8")
    moved = on_huge_pages([w, None, q])
    assert moved[1] is None and torch.equal(moved[0], w) and moved[0].data_ptr() != w.data_ptr()
    assert isinstance(moved[2], QuantWeight) and moved[2].int8_activations and moved[2].bits == 4
    assert all(torch.equal(getattr(moved[2], k), getattr(q, k)) for k in ("q", "scale", "offset"))
    w.zero_()
    assert moved[0].any()  # a copy, not a view


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_served_models_weights_are_advised_to_huge_pages(tmp_path):
    make_checkpoint(tmp_path, arch="llama")
    base = Llama(read_config(tmp_path), read_weights(tmp_path), max_len=64)
    served = served_as(base, "w4a8")
    for t in (served.layers[0]["qkv"].q, served.layers[-1]["down"].scale, served.norm, served.head_w.q):
        assert mapping_of(t).get("THPeligible") == "1"
    assert huge_page_mb() is not None  # what bench reports (0 where none were granted)
