"""Where a slow step's Selector and compact rebuild run: inline, or on a CUDA side stream.

METHOD.md section 4: the reference overlaps the Selector and the rebuild of the compact buffer
with the following layers' work on a second CUDA stream; a sequence whose rebuild is not ready
yet reads densely. A rebuild is staged (packed into separate tensors) and committed into the
layer's compact buffer when its layer next runs and finds it ready. On CPU it runs inline and
commits at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from sfi.rows import Rows


@dataclass
class StagedCompact:
    """A rebuilt compact memory for some sequences of one layer.

    Attributes:
        rows: the sequences it belongs to.
        keys, values: ``[n, H, W, D]`` packed sink + selected entries.
        positions: ``[n, H, W]`` the cache positions they came from.
        width: the compact buffer's width (slots) when it was planned.
        ready: whether the work that produces it has finished.
        wait: make the current stream wait for it (no-op when it ran inline).
    """

    rows: Rows
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    width: int
    ready: Callable[[], bool]
    wait: Callable[[], None]


Rebuild = Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class Rebuilder(Protocol):
    """Runs a rebuild (scorer + top-K + packing) and hands back its staged result."""

    asynchronous: bool

    def submit(self, rows: Rows, rebuild: Rebuild, inputs: list[torch.Tensor],
               width: int) -> StagedCompact:
        """``inputs`` are the tensors the rebuild reads (kept alive for another stream)."""
        ...


def _always() -> bool:
    return True


def _nothing() -> None:
    return None


class InlineRebuilder:
    """Runs the rebuild at once on the current stream (CPU, or overlap switched off)."""

    asynchronous = False

    def submit(self, rows: Rows, rebuild: Rebuild, inputs: list[torch.Tensor],
               width: int) -> StagedCompact:
        keys, values, positions = rebuild()
        return StagedCompact(rows, keys, values, positions, width, _always, _nothing)


class SideStreamRebuilder:
    """Runs the rebuild on a second CUDA stream, ordered after the work already queued."""

    asynchronous = True

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)

    def submit(self, rows: Rows, rebuild: Rebuild, inputs: list[torch.Tensor],
               width: int) -> StagedCompact:
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)
        for tensor in inputs:  # memory made on the main stream, read on the side stream
            tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            keys, values, positions = rebuild()
            done = torch.cuda.Event()
            done.record(self.stream)

        def wait() -> None:
            main.wait_event(done)
            for tensor in (keys, values, positions):
                tensor.record_stream(main)

        return StagedCompact(rows, keys, values, positions, width, done.query, wait)


def make_rebuilder(device: torch.device, overlap: bool) -> Rebuilder:
    if overlap and device.type == "cuda":
        return SideStreamRebuilder(device)
    return InlineRebuilder()
