"""What a prompt can be, and its tokens: text, a chat conversation or token ids, one or a batch.

:func:`encode_prompts` turns whatever :func:`sfi.generate` was given into left-padded token ids
and their attention mask. Text is tokenized as it is (or, with ``chat``, as a user message in the
tokenizer's chat template); a conversation (a list of ``{"role": ..., "content": ...}``
messages) always goes through the chat template, with the assistant's turn opened; token ids are
used as given.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from sfi.errors import PromptError

Message: TypeAlias = Mapping[str, Any]
"""One chat message: ``{"role": "user" | "system" | "assistant", "content": str}``."""
Prompt: TypeAlias = str | Sequence[Message] | Sequence[int] | torch.Tensor
"""One prompt: text, a conversation, or token ids (a list, or a 1-D tensor)."""
Prompts: TypeAlias = Prompt | Sequence[Prompt]
"""One prompt, or a batch of them (a list; a 2-D tensor of token ids is a batch too)."""

EMPTY = "the prompt is empty: give some text, a chat message list or token ids to continue"


@dataclass(frozen=True)
class EncodedPrompts:
    """A batch of prompts as the model takes them.

    Attributes:
        input_ids: ``[B, T]`` token ids, left-padded.
        attention_mask: ``[B, T]``, 1 on real tokens, 0 on padding.
        single: whether one prompt was given (``generate`` then returns one result).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    single: bool


def _is_ids(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 1
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value))


def _is_conversation(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0
            and all(isinstance(v, Mapping) for v in value))


def _check_tensor(prompt: torch.Tensor, dims: tuple[int, ...]) -> None:
    if prompt.dim() not in dims or prompt.numel() == 0 or prompt.is_floating_point() \
            or prompt.is_complex() or prompt.dtype == torch.bool:
        raise PromptError("a tensor prompt must hold token ids: integers, [T] or [B, T]")


def split_prompts(prompt: Prompts) -> tuple[list[Prompt], bool]:
    """``(the prompts as a list, whether one was given)``; refuses what is none of the forms."""
    if isinstance(prompt, torch.Tensor):
        _check_tensor(prompt, (1, 2))
        return ([prompt] if prompt.dim() == 1 else list(prompt)), prompt.dim() == 1
    if isinstance(prompt, str) or _is_ids(prompt) or _is_conversation(prompt):
        return [prompt], True
    if not isinstance(prompt, Sequence) or not prompt:
        raise PromptError(EMPTY if isinstance(prompt, Sequence) else
                          f"a prompt is text, a chat message list or token ids, got "
                          f"{type(prompt).__name__}")
    return list(prompt), False


def _ids_of(tokenizer: Any, prompt: Prompt, chat: bool, vocab: int | None) -> list[int]:
    """One prompt's token ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError(EMPTY)
        if chat:
            return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
        return list(tokenizer(prompt)["input_ids"])
    if _is_conversation(prompt):
        for message in prompt:
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"),
                                                                          str):
                raise PromptError("each chat message needs a 'role' and a 'content' string, got "
                                  f"{dict(message)!r}")
        return chat_ids(tokenizer, list(prompt))
    if _is_ids(prompt):
        if chat:
            raise PromptError("chat applies the chat template to text; token ids are used as "
                              "given (pass the text, or a chat message list)")
        if isinstance(prompt, torch.Tensor):
            _check_tensor(prompt, (1,))
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else [int(v) for v in prompt]
        bad = [v for v in ids if v < 0 or (vocab is not None and v >= vocab)]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary (0 to "
                              f"{(vocab or 1) - 1})")
        return ids
    if isinstance(prompt, Sequence) and not prompt:
        raise PromptError(EMPTY)
    raise PromptError("each prompt of a batch is text, a chat message list or token ids, got "
                      f"{type(prompt).__name__}")


def chat_ids(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """The token ids of a conversation in ``tokenizer``'s chat template, the assistant's turn
    opened (what ``sfi.generate`` and the server's chat endpoint feed the model)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this tokenizer has no chat template: pass the prompt as text")
    text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def pad_id(tokenizer: Any) -> int:
    """The id that fills left padding: the tokenizer's pad token, else its end of sequence."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            return value
    return 0


def encode_prompts(tokenizer: Any, prompt: Prompts, chat: bool, device: torch.device,
                   vocab: int | None = None) -> EncodedPrompts:
    """Token ids of ``prompt`` (any form of :data:`Prompts`), left-padded to one length.

    Args:
        tokenizer: the model's tokenizer.
        prompt: text, a conversation, token ids, or a list of them (a batch).
        chat: wrap text prompts in the chat template as a user message.
        device: where the tensors go.
        vocab: token ids must lie below this (the model's embedding rows); None: not checked.
    """
    prompts, single = split_prompts(prompt)
    rows = [_ids_of(tokenizer, p, chat, vocab) for p in prompts]
    width = max(len(r) for r in rows)
    fill = pad_id(tokenizer)
    ids = torch.tensor([[fill] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return EncodedPrompts(ids.to(device), mask.to(device), single)
