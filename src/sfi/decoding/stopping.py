"""When a sequence ends, and its text: :class:`StopChecker` for one sequence, :class:`Outputs`
for the rows of a batch and the caller's streaming callback.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from sfi.errors import SFIError

_DECODE_MARGIN = 8  # characters at the end of the text that the next token may still change


class StopChecker:
    """When one sequence ends, and its text: an end-of-sequence token (not kept), the earliest
    stop string (the text is cut before it), or ``max_tokens`` tokens.

    Args:
        tokenizer: decodes the tokens (only needed when there are stop strings, or for
            :attr:`text`).
        eos: end-of-sequence token ids.
        stop: strings that end the sequence.
        max_tokens: tokens kept at most.
    """

    def __init__(self, tokenizer: Any, eos: Collection[int], stop: Sequence[str] = (),
                 max_tokens: int | None = None):
        if any(not isinstance(s, str) or not s for s in stop):
            raise SFIError("stop strings must be non-empty strings")
        self.tokenizer = tokenizer
        self.eos = eos
        self.stop = tuple(stop)
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._text: str | None = None
        self._longest = max((len(s) for s in self.stop), default=0)
        self._scanned = 0  # characters of the text already scanned without a stop string
        self._cut_at: int | None = None
        self._last_scanned: str | None = None  # the decoded text the last scan looked at

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> bool:
        """Take the next token; returns whether the sequence has ended."""
        if self.done:
            return True
        if token in self.eos:
            self.finish_reason = "stop"
            return True
        self.tokens.append(token)
        self._text = None
        if self.stop and self._cut() is not None:
            self.finish_reason = "stop"
        elif self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        return self.done

    def decoded(self) -> str:
        """The tokens kept so far, decoded (special tokens skipped)."""
        if self._text is None:
            self._text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return self._text

    def _cut(self) -> int | None:
        """Where the earliest stop string starts; scans only the text not scanned before
        (with a margin for a multi-byte character that the last token completed)."""
        if self._cut_at is not None:
            return self._cut_at
        text = self.decoded()
        if text is self._last_scanned:  # no token since the last scan
            return None
        self._last_scanned = text
        start = max(0, self._scanned - self._longest - _DECODE_MARGIN)
        hits = [at for at in (text.find(s, start) for s in self.stop) if at >= 0]
        if hits:
            self._cut_at = min(hits)
        else:
            self._scanned = len(text)
        return self._cut_at

    @property
    def text(self) -> str:
        """The text so far, cut before the earliest stop string."""
        cut = self._cut() if self.stop else None
        return self.decoded() if cut is None else self.decoded()[:cut]

    @property
    def settled_text(self) -> str:
        """What can be streamed now: :attr:`text`, less a tail that could still grow into a
        stop string (all of it once the sequence has ended)."""
        text = self.text
        if self.done or not self.stop:
            return text
        for size in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return text[:-size]
        return text


class Outputs:
    """The new tokens of a batch's rows: one :class:`StopChecker` per row, and ``on_token(row,
    token_id)`` called for every token a row keeps (an end-of-sequence token is not kept)."""

    def __init__(self, checkers: Sequence[StopChecker],
                 on_token: Callable[[int, int], None] | None = None) -> None:
        self.checkers = list(checkers)
        self.on_token = on_token

    @property
    def done(self) -> bool:
        """Whether every row has ended."""
        return all(checker.done for checker in self.checkers)

    def push(self, rows: Sequence[Sequence[int]]) -> None:
        """Each row's next tokens (``rows[r]``, in order); a row that has ended takes none."""
        for row, tokens in enumerate(rows):
            checker = self.checkers[row]
            for token in tokens:
                if checker.done:
                    break
                kept = len(checker.tokens)
                checker.push(token)
                if self.on_token is not None and len(checker.tokens) > kept:
                    self.on_token(row, token)

    def wanted(self) -> tuple[list[bool], int]:
        """The rows still going, and the most tokens any of them may still take."""
        return ([not c.done for c in self.checkers],
                max((c.max_tokens - len(c.tokens) for c in self.checkers
                     if not c.done and c.max_tokens is not None), default=0))
