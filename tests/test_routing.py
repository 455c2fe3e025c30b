"""Routing is scoped: a cache routes the model through sfi while it lives, and the model is
left as it was found afterwards (attention implementation, hooks)."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

import sfi
from sfi import SFIConfig, SlowFastCache
from sfi.errors import SFIError
from sfi.hf.context import current_step
from sfi.hf.facts import cache_argument
from sfi.hf.routing import routed

CONFIG = SFIConfig(sink=2, recent=6, k_head=8, force_sparse=True, trigger="fixed", period=3)


def _hooks(model) -> int:
    return len(model._forward_pre_hooks) + len(model._forward_hooks)


def _untouched(model, implementation) -> bool:
    return (model.config._attn_implementation == implementation and _hooks(model) == 0
            and not hasattr(model, "_sfi_routing"))


def test_a_cache_routes_for_its_lifetime_and_restores_the_model():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    assert before != "sfi" and _untouched(model, before)
    with SlowFastCache(model, CONFIG) as cache:
        assert model.config._attn_implementation == "sfi" and _hooks(model) == 2
        other = SlowFastCache(model, CONFIG)  # scopes nest
        cache.close()
        assert model.config._attn_implementation == "sfi"
        del other
        gc.collect()
    assert _untouched(model, before)


def test_a_garbage_collected_cache_unroutes():
    model = tiny_model("qwen2")
    before = model.config._attn_implementation
    cache = SlowFastCache(model, CONFIG)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 256, (1, 30)), use_cache=True,
              **{cache_argument(model): cache})
    del cache
    gc.collect()
    assert _untouched(model, before)


def test_generate_leaves_the_model_as_it_found_it(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    before = model.config._attn_implementation
    sfi.generate(model, tok, "A prompt. Another sentence.", config=CONFIG, max_new_tokens=4)
    gc.collect()
    assert _untouched(model, before)


def test_a_forward_that_raises_leaves_no_step_behind():
    model = tiny_model("llama")
    key = cache_argument(model)
    ids = torch.randint(0, 256, (2, 20))
    with routed(model), torch.inference_mode():
        cache = SlowFastCache(model, CONFIG)
        model(input_ids=ids, use_cache=True, **{key: cache})
        with pytest.raises(SFIError, match="holds 2 sequences"):
            model(input_ids=ids[:1, :1], use_cache=True, **{key: cache})
        assert current_step() is None
        # the same routed model, with transformers' own cache, computes what it computes alone
        routed_logits = model(input_ids=ids, use_cache=True,
                              **{key: DynamicCache(config=model.config)}).logits
        del cache
    gc.collect()
    with torch.inference_mode():
        plain = model(input_ids=ids, use_cache=True,
                      **{key: DynamicCache(config=model.config)}).logits
    torch.testing.assert_close(routed_logits, plain)


def test_two_threads_decode_one_model_at_once(tiny_llama_with_tokenizer):
    """The routing hook's open forwards are per thread: two threads sharing a model (a server
    and a script, two engines) must not pop each other's steps."""
    import threading

    model, tok = tiny_llama_with_tokenizer
    config = SFIConfig(sink=2, recent=8, k_head=8, force_sparse=True, min_refresh_gap=2)
    prompts = ["One prompt. With sentences! " * 6, "Another, different prompt. Yes. " * 5]
    alone = [sfi.generate(model, tok, p, config=config, max_new_tokens=40).token_ids
             for p in prompts]
    together: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            together[i] = sfi.generate(model, tok, prompts[i], config=config,
                                       max_new_tokens=40).token_ids
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [together[0], together[1]] == alone
