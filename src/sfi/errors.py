"""Errors that sfi raises for bad input: each message names the problem and the value."""

from __future__ import annotations


class SFIError(ValueError):
    """Base class of the errors that sfi raises for bad input."""


class SFIConfigError(SFIError):
    """A configuration field is out of range or of the wrong type."""


class ModelNotFoundError(SFIError):
    """A model name or path that sfi cannot resolve."""


class UnsupportedModelError(SFIError):
    """A model whose attention cannot be routed through sfi."""


class PromptError(SFIError):
    """An empty prompt, or one that does not fit in the model's context."""
