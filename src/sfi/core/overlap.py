"""Where a slow step's Selector and compact rebuild run: stacked over layers, inline, or on a
CUDA side stream.

docs/method.md section 4: the reference overlaps the Selector and the rebuild of the compact buffer
with the following layers' work on a second CUDA stream; a sequence whose rebuild is not ready
yet reads densely. A rebuild is staged (packed into separate tensors) and committed into the
layer's compact buffer when its layer next runs and finds it ready. On CPU the refreshes of a
step wait until its forward ends and are selected together, several layers' evidence stacked
into one call (:class:`StackingRebuilder`; the Selector's cost is mostly per operation, not
per position, at these sizes).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from sfi.core.refresh_selection import PreviousSelection, SelectionGroup, select_groups
from sfi.core.rows import Rows
from sfi.core.scorers import Evidence, scores_rows_alone, stack_evidence


@dataclass
class StagedCompact:
    """A rebuilt compact memory for some sequences of one layer.

    Attributes:
        rows: the sequences it belongs to.
        keys, values: ``[n, H, W, D]`` packed sink + selected entries.
        positions: ``[n, H, W]`` the cache positions they came from.
        width: the compact buffer's width (slots) when it was planned.
        ready: whether the work that produces it has finished (or was dropped).
        wait: make the current stream wait for it (no-op when it ran inline).
        dropped: the refresh will never land (its forward failed): the layer keeps its memory.
    """

    rows: Rows
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    width: int
    ready: Callable[[], bool]
    wait: Callable[[], None]
    dropped: bool = False


Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class Refresh:
    """One layer's refresh of some rows: select from the evidence (stages 1-6,
    :func:`sfi.core.refresh_selection.select_groups`), then ``pack`` the slots ``[n, H, k]`` into
    ``(keys, values, positions)`` of the new compact memory, ``width`` slots planned."""

    rows: Rows
    evidence: Evidence
    groups: Sequence[SelectionGroup]
    k: torch.Tensor
    pins: torch.Tensor
    previous: PreviousSelection | None
    pack: Callable[[torch.Tensor], Packed]
    width: int

    def select(self) -> torch.Tensor:
        return select_groups(self.groups, self.evidence, self.k, self.pins, self.previous)

    def run(self) -> Packed:
        return self.pack(self.select())

    def stack_key(self) -> tuple | None:
        """Refreshes with equal keys can be selected in one call, their evidence stacked
        along the rows (None: this one cannot: several groups, or a scorer that looks past
        each row's own evidence)."""
        if len(self.groups) != 1 or self.groups[0].rows is not None:
            return None
        group, e = self.groups[0], self.evidence
        if not scores_rows_alone(group.scorer):
            return None
        previous = self.previous or PreviousSelection()
        return (id(group.scorer), group.rule, tuple(e.logits.shape[1:]),
                e.probabilities is not None, e.pads is not None,
                previous.selected is not None, previous.pinned is not None)


class Rebuilder(Protocol):
    """Runs refreshes (scorer + top-K + packing) and hands back their staged results."""

    asynchronous: bool

    def submit(self, refresh: Refresh, inputs: list[torch.Tensor]) -> StagedCompact:
        """``inputs`` are the tensors the refresh reads (kept alive for another stream)."""
        ...

    def flush(self) -> None:
        """Finish every refresh submitted so far (the end of a forward)."""
        ...

    def discard(self) -> None:
        """Drop the refreshes still waiting (a forward that raised before its end)."""
        ...


def _always() -> bool:
    return True


def _nothing() -> None:
    return None


class _NothingWaits:
    """A rebuilder that starts each refresh when submitted: nothing to flush or discard."""

    def flush(self) -> None:
        return None

    def discard(self) -> None:
        return None


class InlineRebuilder(_NothingWaits):
    """Runs the rebuild at once on the current stream (CUDA with overlap switched off)."""

    asynchronous = False

    def submit(self, refresh: Refresh, inputs: list[torch.Tensor]) -> StagedCompact:
        keys, values, positions = refresh.run()
        return StagedCompact(refresh.rows, keys, values, positions, refresh.width, _always,
                             _nothing)


class StackingRebuilder:
    """Keeps a forward's refreshes until it ends (:meth:`flush`), then selects those that can
    go together in one call per kind (:meth:`Refresh.stack_key`: the rows of several layers
    stacked) and packs each layer's memory; a stack holds at most ``limit_bytes`` of evidence
    (a fuller one is flushed first), and a refresh that cannot be stacked runs at once. A
    refresh is staged until then: its rows have no new memory before the forward's end, and
    none needs one (the layer's next use is the next forward)."""

    asynchronous = False

    def __init__(self, limit_bytes: int = 16 * 2 ** 20):
        self.limit_bytes = limit_bytes
        self._waiting: list[tuple[Refresh, StagedCompact]] = []
        self._bytes = 0

    @property
    def waiting(self) -> bool:
        """Whether refreshes wait for a :meth:`flush`."""
        return bool(self._waiting)

    def submit(self, refresh: Refresh, inputs: list[torch.Tensor]) -> StagedCompact:
        staged = StagedCompact(refresh.rows, None, None, None, refresh.width,  # type: ignore[arg-type]
                               _always, self.flush)
        staged.ready = partial(_landed, weakref.ref(staged))  # (no cycle: freed when dropped)
        if refresh.stack_key() is None:
            _land(staged, refresh.run())
            return staged
        e = refresh.evidence
        size = sum(t.numel() * t.element_size() for t in (e.logits, e.probabilities)
                   if t is not None)
        if self._waiting and self._bytes + size > self.limit_bytes:
            self.flush()
        self._waiting.append((refresh, staged))
        self._bytes += size
        return staged

    def flush(self) -> None:
        waiting, self._waiting, self._bytes = self._waiting, [], 0
        kinds: dict[tuple, list[tuple[Refresh, StagedCompact]]] = {}
        for refresh, staged in waiting:
            kinds.setdefault(refresh.stack_key(), []).append((refresh, staged))  # type: ignore[arg-type]
        try:
            for together in kinds.values():
                refreshes = [r for r, _ in together]
                for (refresh, staged), slots in zip(together, _select_stacked(refreshes)):
                    _land(staged, refresh.pack(slots))
        finally:  # a failed selection drops the rest: their layers keep their memories
            for _, staged in waiting:
                staged.dropped = staged.keys is None

    def discard(self) -> None:
        waiting, self._waiting, self._bytes = self._waiting, [], 0
        for _, staged in waiting:
            staged.dropped = True


def _select_stacked(refreshes: list[Refresh]) -> list[torch.Tensor]:
    """Each refresh's slots ``[n_i, H, k_i]``, selected in one call over the stacked rows (the
    same as selecting each alone: every stage works row by row)."""
    if len(refreshes) == 1:
        return [refreshes[0].select()]
    first = refreshes[0]
    previous = None
    if first.previous is not None:  # (equal stack keys: every refresh holds the same masks)
        previous = PreviousSelection(*(
            None if getattr(first.previous, name) is None
            else torch.cat([getattr(r.previous, name) for r in refreshes])
            for name in ("selected", "pinned")))
    slots = select_groups(first.groups, stack_evidence([r.evidence for r in refreshes]),
                          torch.cat([r.k for r in refreshes]),
                          torch.cat([r.pins for r in refreshes]), previous)
    out, start = [], 0
    for r in refreshes:
        n = len(r.k)
        out.append(slots[start: start + n, :, : int(r.k.max())])
        start += n
    return out


def _landed(staged: weakref.ref[StagedCompact]) -> bool:
    """Whether a staged refresh has its memory (or was dropped)."""
    this = staged()
    return this is None or this.keys is not None or this.dropped


def _land(staged: StagedCompact, packed: Packed) -> None:
    staged.keys, staged.values, staged.positions = packed


class SideStreamRebuilder(_NothingWaits):
    """Runs the rebuild on a second CUDA stream, ordered after the work already queued."""

    asynchronous = True

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)

    def submit(self, refresh: Refresh, inputs: list[torch.Tensor]) -> StagedCompact:
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)
        for tensor in inputs:  # memory made on the main stream, read on the side stream
            tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            keys, values, positions = refresh.run()
            done = torch.cuda.Event()
            done.record(self.stream)

        def wait() -> None:
            main.wait_event(done)
            for tensor in (keys, values, positions):
                tensor.record_stream(main)

        return StagedCompact(refresh.rows, keys, values, positions, refresh.width, done.query,
                             wait)


def make_rebuilder(device: torch.device, overlap: bool) -> Rebuilder:
    """Refreshes stacked over layers on CPU; on CUDA a side stream (with ``overlap``) or
    inline."""
    if overlap and device.type == "cuda":
        return SideStreamRebuilder(device)
    return StackingRebuilder() if device.type == "cpu" else InlineRebuilder()
