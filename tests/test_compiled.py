"""The compiled decode step (``sfi.decoding.compiled``): a compiled step computes what the eager one
does, for SFI's slow, fast and dense steps and for the dense baselines; compiling is undone
cleanly; only one-token steps are compiled."""

from __future__ import annotations

import pytest
import torch

from sfi import SFIConfig
from sfi.decoding.compiled import compile_decode, compiled_forward, eager_decode
from sfi.decoding.decode_step import decode_one, extended_mask
from sfi.decoding.prefill import prefill
from sfi.hf.methods import build_cache
from sfi.weights import layout as weight_layout

STEPS = 12

# inductor builds C++ for the CPU: where it cannot (no compiler), the int8 probe says so too
pytestmark = pytest.mark.skipif(not weight_layout.format_runs("int8", torch.float32),
                                reason="torch.compile's inductor cannot build here")


def _decode(model, tokenizer, method: str, ids: torch.Tensor, config: SFIConfig | None,
            mask: torch.Tensor | None = None):
    """Greedy steps after a prefill (of a left-padded batch where ``mask [B, L]`` says):
    ``(logits [steps, B, V], each step's kinds)``."""
    cache = build_cache(model, tokenizer, method, config=config,
                        capacity=ids.shape[1] + STEPS + 1)
    with torch.inference_mode():
        positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
        token = prefill(model, cache, ids, attention_mask=mask, positions=positions).argmax(-1)
        position = torch.full((ids.shape[0],), ids.shape[1]) if mask is None else mask.sum(-1)
        logits, kinds = [], []
        for _ in range(STEPS):
            if mask is not None:
                mask = extended_mask(mask, 1)
            step = decode_one(model, cache, token, position, mask)
            logits.append(step)
            kinds.append(tuple(cache.step_kinds()))
            token, position = step.argmax(-1), position + 1
    return torch.stack(logits), kinds


SFI_CASES = {  # (configuration, left padding of the second row)
    "sfi": (dict(coverage_layers=0, trigger="fixed", period=4), 0),
    # rows refreshing at different steps (recent windows starting apart), one padded
    "sfi-rows": (dict(coverage_layers=0, trigger="random", random_period_min=2,
                      random_period_max=5), 30),
    # coverage_retry: flagged steps the routing hook runs again, through the graphs above
    "sfi-retry": (dict(page_size=4, coverage_layers=2, coverage_threshold=0.3, coverage_gap=1,
                       coverage_retry=True, trigger="fixed", period=4), 0),
    # retry_margin: uncertain steps the routing hook runs again (this tiny model's margins are
    # 1e-7 to 5e-6)
    "sfi-margin": (dict(coverage_layers=0, trigger="fixed", period=4, retry_margin=1.5e-6), 0),
    # probes that also read the page after the most attended one (coverage_next)
    "sfi-next": (dict(page_size=4, coverage_layers=2, coverage_threshold=0.5, coverage_gap=1,
                      coverage_next=True, trigger="fixed", period=4), 0),
    # probes that flag a copy about to run past what the memory holds (coverage_copy)
    "sfi-copy": (dict(page_size=4, coverage_layers=2, coverage_threshold=1.0, coverage_gap=1,
                      coverage_copy=0.05, trigger="fixed", period=4), 0),
    # repairing slow steps: eager blocks (a row's slow step, the other row fast) between graphs
    "sfi-repair": (dict(coverage_layers=0, trigger="random", random_period_min=2,
                        random_period_max=5, repair_tokens=8), 30),
}


@pytest.mark.parametrize("method", [*SFI_CASES, "full-static", "full"])
def test_a_compiled_step_equals_the_eager_one(tiny_llama_with_tokenizer, method):
    """Slow, fast and dense steps, a padded batch whose rows refresh at different steps,
    coverage_retry's and retry_margin's steps done again, and repairing slow steps' eager
    blocks."""
    model, tokenizer = tiny_llama_with_tokenizer
    name = method
    torch.manual_seed(1)
    ids = torch.randint(5, 5000, (2, 96))
    config, mask = None, None
    if method in SFI_CASES:
        fields, padding = SFI_CASES[method]
        config = SFIConfig(sink=2, recent=8, k_head=8, force_sparse=True, **fields)
        if padding:
            mask = torch.ones_like(ids)
            mask[1, :padding] = 0
        method = "sfi"
    expected, eager_kinds = _decode(model, tokenizer, method, ids, config, mask)
    compiled = compile_decode(model)
    try:
        got, kinds = _decode(model, tokenizer, method, ids, config, mask)
    finally:
        eager_decode(model)
    assert kinds == eager_kinds
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    blocks = compiled.eager_calls - 1  # after the prefill: repairing slow steps' blocks
    if config is not None and config.repair_tokens:
        assert blocks > 0 and compiled.compiled_steps + blocks == STEPS
    elif config is not None and (config.coverage_retry or config.retry_margin):
        # steps done again, compiled too
        assert compiled.compiled_steps > STEPS
    else:
        assert blocks == 0 and compiled.compiled_steps == STEPS
    if config is not None:
        assert {"slow", "fast"} <= {kind for step in kinds for kind in step}
    if name == "sfi-rows":  # the rows refreshed at different steps
        assert any(len(set(step)) > 1 for step in kinds)
    if name == "sfi-copy":  # copy flags refresh rows between the period's slow steps
        assert sum(step.count("slow") for step in kinds) > 2 * (STEPS // 4 + 1)
    # (a later SFI case may run through the graph an earlier one built; sfi-rows's mask makes
    # another)
    assert compiled.compile_seconds > 0 or (name in SFI_CASES and name != "sfi")


def test_a_compiled_step_writes_sliding_window_layers(smol_tokenizer):
    """Layers that keep their own sliding window (transformers' layer, attended by SDPA in the
    step's operator) are written by their own update inside the graph, as in an eager step."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(smol_tokenizer), hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=24,
                           max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.sfi_tokenizer = smol_tokenizer
    ids = torch.randint(5, 5000, (1, 40))
    config = SFIConfig(trigger="fixed", period=4)
    expected, eager_kinds = _decode(model, smol_tokenizer, "sfi", ids, config)
    compile_decode(model)
    try:
        got, kinds = _decode(model, smol_tokenizer, "sfi", ids, config)
    finally:
        eager_decode(model)
    assert kinds == eager_kinds
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_compiling_is_idempotent_and_undone(tiny_llama_with_tokenizer):
    model, _ = tiny_llama_with_tokenizer
    implementation = model.config._attn_implementation
    compiled = compile_decode(model)
    assert compile_decode(model) is compiled and compiled_forward(model) is compiled
    assert model.config._attn_implementation == "sfi"  # routed while compiled
    eager_decode(model)
    assert compiled_forward(model) is None and "forward" not in model.__dict__
    assert model.config._attn_implementation == implementation
    eager_decode(model)  # nothing left to undo


@pytest.mark.model
def test_compiled_steps_of_a_real_model_probe_coverage_as_eager_ones(default_model):
    """A real model's coverage probes rarely flag a row; a compiled step whose probes read a
    query buffer the graph had reused since flagged every other step."""
    from sfi.texts import essay

    model, tokenizer = default_model
    ids = torch.tensor([tokenizer(essay(2048, tokenizer))["input_ids"][:2048]])
    config = SFIConfig(force_sparse=True)

    def decode() -> tuple[torch.Tensor, list[str], dict]:
        cache = build_cache(model, tokenizer, "sfi", config=config, capacity=2048 + STEPS + 1)
        with torch.inference_mode():
            token = prefill(model, cache, ids, chunk=1024).argmax(-1)
            position = torch.full((1,), ids.shape[1])
            logits, kinds = [], []
            for _ in range(STEPS):
                logits.append(decode_one(model, cache, token, position))
                kinds.extend(cache.step_kinds())
                token, position = logits[-1].argmax(-1), position + 1
        return torch.stack(logits), kinds, cache.stats().to_dict()["refresh_reasons"]

    expected = decode()
    compile_decode(model)
    try:
        got = decode()
    finally:
        eager_decode(model)
    assert got[1] == expected[1] and got[2] == expected[2]
    assert expected[2]["coverage"] < STEPS // 2
    torch.testing.assert_close(got[0], expected[0], rtol=1e-3, atol=1e-3)
