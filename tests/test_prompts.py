"""What sfi.generate takes as a prompt, and what it says when SFI stays dense: text, a chat
conversation, token ids, one or a batch; clear errors for anything else."""

from __future__ import annotations

import logging

import pytest
import torch

import sfi
from sfi import PromptError, SFIConfig
from sfi.decoding.prompts import encode_prompts

QUESTION = "Name three colours of the sea. The sky is blue and the sea is calm."


def _ids(result) -> list[int]:
    return result.token_ids


def test_a_conversation_is_the_chat_template_of_its_messages(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    messages = [{"role": "user", "content": QUESTION}]
    as_text = sfi.generate(model, tok, QUESTION, chat=True, max_new_tokens=6, mode="full")
    as_messages = sfi.generate(model, tok, messages, max_new_tokens=6, mode="full")
    assert as_messages.prompt_tokens == as_text.prompt_tokens
    assert _ids(as_messages) == _ids(as_text)
    plain = sfi.generate(model, tok, QUESTION, max_new_tokens=6, mode="full")
    assert plain.prompt_tokens < as_text.prompt_tokens  # the template's turns were added


def test_token_ids_are_used_as_given(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    ids = tok(QUESTION)["input_ids"]
    from_text = sfi.generate(model, tok, QUESTION, max_new_tokens=6, mode="full")
    for given in (ids, torch.tensor(ids)):
        from_ids = sfi.generate(model, tok, given, max_new_tokens=6, mode="full")
        assert from_ids.prompt_tokens == len(ids) and _ids(from_ids) == _ids(from_text)


def test_a_batch_mixes_the_forms_and_each_row_is_as_alone(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    prompts = [QUESTION, [{"role": "user", "content": "Hello there, how are you?"}],
               tok("A third prompt, as token ids.")["input_ids"]]
    batch = sfi.generate(model, tok, prompts, max_new_tokens=5, mode="full")
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, row in zip(prompts, batch, strict=True):
        alone = sfi.generate(model, tok, prompt, max_new_tokens=5, mode="full")
        assert _ids(row) == _ids(alone)
    square = sfi.generate(model, tok, torch.tensor([prompts[2], prompts[2]]), max_new_tokens=3,
                          mode="full")
    assert isinstance(square, list) and len(square) == 2


def test_left_padding_puts_the_real_tokens_last(smol_tokenizer):
    encoded = encode_prompts(smol_tokenizer, [[5, 6, 7], [8]], False, torch.device("cpu"))
    assert encoded.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert encoded.input_ids[:, -1].tolist() == [7, 8] and not encoded.single


@pytest.mark.parametrize("prompt, kwargs, message", [
    ([], {}, "the prompt is empty"),
    ("  ", {}, "the prompt is empty"),
    ([{"role": "user"}], {}, "needs a 'role' and a 'content' string"),
    ([{"role": "user", "content": 3}], {}, "needs a 'role' and a 'content' string"),
    ([1, 2, 10**9], {}, "token id 1000000000 is outside the vocabulary"),
    ([1, -2], {}, "token id -2 is outside the vocabulary"),
    ([1, 2, 3], {"chat": True}, "token ids are used as given"),
    (torch.tensor([0.5, 1.5]), {}, "a tensor prompt must hold token ids"),
    (42, {}, "a prompt is text, a chat message list or token ids, got int"),
    (["fine", 3.5], {}, "each prompt of a batch is text, a chat message list or token ids"),
    (["fine", torch.tensor([], dtype=torch.long)], {}, "a tensor prompt must hold token ids"),
    (["fine", torch.tensor([1.0, 2.0])], {}, "a tensor prompt must hold token ids"),
])
def test_a_prompt_that_is_none_of_the_forms_is_refused(tiny_llama_with_tokenizer, prompt,
                                                       kwargs, message):
    model, tok = tiny_llama_with_tokenizer
    with pytest.raises(PromptError, match=message):
        sfi.generate(model, tok, prompt, max_new_tokens=2, **kwargs)


def test_a_tokenizer_without_a_chat_template_refuses_a_conversation(smol_tokenizer, monkeypatch):
    monkeypatch.setattr(smol_tokenizer, "chat_template", None)
    with pytest.raises(PromptError, match="no chat template"):
        encode_prompts(smol_tokenizer, [{"role": "user", "content": "hi"}], False,
                       torch.device("cpu"))


def test_k_fraction_alone_is_the_budget():
    config = SFIConfig(k_fraction=0.15)
    assert config.k_head is None and config.budget(1000) == 150
    assert SFIConfig().k_head == 2048 and type(SFIConfig().k_head) is int
    with pytest.raises(sfi.SFIConfigError, match="not both"):
        SFIConfig(k_head=2048, k_fraction=0.15)
    assert SFIConfig().replace(k_fraction=0.1).k_head is None  # dataclasses.replace refuses
    assert SFIConfig(k_fraction=0.1).replace(k_head=512).k_fraction is None
    from sfi.hf.methods import parse_method

    assert parse_method("sfi[k_fraction=0.1]").sfi_config().budget(1000) == 100


def test_sfi_says_once_why_it_stayed_dense(tiny_llama_with_tokenizer, caplog, monkeypatch):
    import sfi.notices

    monkeypatch.setattr(sfi.notices, "_said", set())
    model, tok = tiny_llama_with_tokenizer
    with caplog.at_level(logging.WARNING, logger="sfi"):
        first = sfi.generate(model, tok, QUESTION, max_new_tokens=4)
        again = sfi.generate(model, tok, QUESTION, max_new_tokens=4)
    assert first.stats.dense_steps > 0 and first.stats.fast_steps == 0
    reason = first.stats.dense_reason
    assert reason is not None and "shorter than" in reason and "tokens" in reason
    assert again.stats.dense_reason == reason
    assert first.stats.to_dict()["dense_reason"] == reason
    notices = [r for r in caplog.records if r.name == "sfi"]
    assert len(notices) == 1 and reason in notices[0].getMessage()


def test_no_dense_reason_where_sfi_ran_sparse_or_full_attention_ran(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    sparse = sfi.generate(model, tok, QUESTION * 4, max_new_tokens=6,
                          config=SFIConfig(sink=2, recent=8, k_head=8, min_skip=0, min_gain=1.0))
    assert sparse.stats.fast_steps > 0 and sparse.stats.dense_reason is None
    full = sfi.generate(model, tok, QUESTION, max_new_tokens=3, mode="full")
    assert full.stats.dense_reason is None


def test_the_top_level_names_are_the_api():
    assert "keep_freed_memory" not in sfi.__all__ and "register_attention" not in sfi.__all__
    for name in sfi.__all__:
        assert getattr(sfi, name) is not None
    assert sfi.texts.essay.__module__ == "sfi.texts"  # submodules by attribute
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(sfi))
    typed = {alias.asname or alias.name: node.module for block in tree.body
             if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
             for node in block.body for alias in node.names}
    assert typed == sfi._EXPORTS  # what type checkers see is what sfi imports
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        sfi.nothing_here  # noqa: B018


def test_a_missing_model_folder_is_named():
    with pytest.raises(sfi.ModelNotFoundError, match=r"no such folder or file: '\./no/such/dir'"):
        sfi.load("./no/such/dir")
