"""Notices to the user through the ``sfi`` logger, each said once per process.

A notice is something the library decided on the user's behalf that changes what they get
(e.g. SFI decoding densely because the context is too short for sparse reads to pay). It is
logged at WARNING, so that Python's default handler prints it without any logging set-up;
``logging.getLogger("sfi").setLevel(logging.ERROR)`` silences it (the ``sfi`` command does, as
it prints the same facts in its summaries).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sfi")
_said: set[str] = set()


def notice_once(message: str) -> bool:
    """Log ``message`` at WARNING unless this process has said it already; returns whether it
    was logged now."""
    if message in _said:
        return False
    _said.add(message)
    logger.warning(message)
    return True
