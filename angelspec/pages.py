"""Memory on transparent huge pages, for what a forward streams: the served weights.

A decoding forward reads every weight once, from memory (a model is larger than the caches). On
4 KB pages that is a TLB miss, a page walk and a fresh start for the hardware prefetcher every
4 KB; on 2 MB pages, every 2 MB. Linux backs an anonymous mapping with 2 MB pages where asked
(madvise MADV_HUGEPAGE, honoured in its default `madvise` mode of transparent huge pages); where it
is not (another OS, THP off), the same memory has 4 KB pages and nothing else differs.

The KV cache stays in torch's own allocations: its layers in one buffer would be views of one
storage, inputs that alias one another and are written to, and torch.compile's graph (the
`inductor` backend) then computed other logits than eager's."""
from __future__ import annotations

import dataclasses
import mmap

import torch

HUGE_PAGE = 2 << 20
LINE = 64  # each tensor starts on a cache line of its own


def zeros_on_huge_pages(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zero-filled tensors of these (shape, dtype), one after another in one anonymous mapping
    (2 MB-aligned, advised to huge pages); they keep it alive between them."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    padded = [-(-n // LINE) * LINE for n in sizes]
    span = -(-sum(padded) // HUGE_PAGE) * HUGE_PAGE  # whole huge pages
    # private (a shared mapping is shmem, whose huge pages are a separate setting) and anonymous:
    # zeros, no page touched yet; a huge page more, to start on one
    mapping = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    buf = torch.frombuffer(mapping, dtype=torch.uint8)
    start = (-buf.data_ptr()) % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, span)
    except (AttributeError, OSError):  # no such advice here: 4 KB pages
        pass
    out, at = [], start
    for (shape, dtype), n, room in zip(specs, sizes, padded):
        out.append(buf[at:at + n].view(dtype).view(shape))
        at += room
    return out


def on_huge_pages(weights: list) -> list:
    """Each weight (a tensor, or a dataclass of tensors such as plugins.linear's QuantWeight; None
    stays None) with its tensors copied, in this order, into one buffer on huge pages: a forward
    that reads them in this order streams one run of memory."""
    def tensor_fields(w) -> list[str]:
        return [f.name for f in dataclasses.fields(w) if isinstance(getattr(w, f.name), torch.Tensor)]

    flat = [t for w in weights if w is not None
            for t in ([w] if isinstance(w, torch.Tensor) else [getattr(w, k) for k in tensor_fields(w)])]
    copies = zeros_on_huge_pages([(tuple(t.shape), t.dtype) for t in flat])
    for copy, t in zip(copies, flat):
        copy.copy_(t)
    copies, out = iter(copies), []
    for w in weights:
        if w is None:
            out.append(None)
        elif isinstance(w, torch.Tensor):
            out.append(next(copies))
        else:
            out.append(dataclasses.replace(w, **{k: next(copies) for k in tensor_fields(w)}))
    return out


def huge_page_mb() -> float | None:
    """MB of this process's memory on huge pages (Linux's AnonHugePages; None where unknown): about
    the served weights' bytes when the system grants them, 0 when it does not."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
