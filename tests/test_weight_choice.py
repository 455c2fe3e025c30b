"""``weights="auto"``: the candidates per CPU and batch, the fidelity gate, the cached verdicts,
and a failed candidate leaving the model as it was."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import tiny_model

import sfi.weights.choice as weight_choice
from sfi.weights.choice import Verdict, candidates, choose_weights
from sfi.weights.int8_linear import Int8Linear
from sfi.weights.layout import PackedLinear, format_runs


@pytest.mark.parametrize("capability, batch, dtype, int8_fast, expected", [
    ("AVX512", 1, torch.float32, True, ("int8", "fp16", "native")),
    ("AVX512_BF16", 1, torch.float32, True, ("int8", "fp16", "native")),
    ("AVX2", 1, torch.float32, True, ("int8", "fp16", "native")),  # sfi's int8 kernel
    ("AVX2", 1, torch.float32, False, ("fp16", "native")),  # no kernel: int8 is slow
    ("AVX2", 1, torch.bfloat16, True, ("int8", "native")),  # fp16 saves nothing over 16 bits
    ("AVX512", 4, torch.float32, True, ("native",)),  # the reduced formats are for batch 1
    ("AVX2", 2, torch.float32, True, ("native",)),
    ("DEFAULT", 1, torch.float32, True, ("native",)),  # neither measured fast: e.g. ARM
])
def test_the_candidates_follow_the_cpu_and_the_batch(capability, batch, dtype, int8_fast,
                                                     expected):
    assert candidates(capability, batch, dtype, int8_fast) == expected


@pytest.mark.parametrize("kl, top1, passed", [
    (0.0, 1.0, True), (0.01, 0.97, True), (0.0101, 1.0, False), (0.0, 0.969, False)])
def test_a_verdict_passes_within_both_bounds(kl, top1, passed):
    assert Verdict("fp16", 511, kl, top1).passed is passed


def _model_and_ids():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(ids).logits
    return model, ids, logits


def _linear_kinds(model):
    return {type(m) for m in model.modules()
            if isinstance(m, (torch.nn.Linear, PackedLinear, Int8Linear))}


@pytest.mark.skipif(not format_runs("int8", torch.float32), reason="inductor does not run here")
def test_a_format_that_passes_is_kept_and_its_verdict_cached(tmp_path, monkeypatch):
    model, ids, _ = _model_and_ids()
    monkeypatch.setattr(weight_choice, "int8_runs_fast", lambda: True)  # as on AVX-512
    monkeypatch.setattr(weight_choice, "MAX_KL", 1e9)  # whatever int8 does to random weights
    monkeypatch.setattr(weight_choice, "MIN_TOP1", 0.0)
    choice = choose_weights(model, ids, key="tiny", capability="AVX512", store=tmp_path)
    assert choice.format == "int8" and choice.measured
    assert _linear_kinds(model) == {Int8Linear}
    assert [v.format for v in choice.verdicts] == ["int8"] and len(list(tmp_path.iterdir())) == 1
    assert "weights auto -> int8 on this AVX512 CPU at batch 1" in choice.summary()

    def no_forward(*args, **kwargs):
        raise AssertionError("a cached verdict needs no forward")

    monkeypatch.setattr("sfi.eval.fidelity.next_token_log_probs", no_forward)
    again, _, _ = _model_and_ids()
    cached = choose_weights(again, ids, key="tiny", capability="AVX512", store=tmp_path)
    assert cached.format == "int8" and not cached.measured and "cached" in cached.summary()
    assert cached.verdicts == choice.verdicts
    # another model name is another model: measured again (here the forward refuses, so the
    # check cannot run and the model stays native)
    other = choose_weights(_model_and_ids()[0], ids, key="other", capability="AVX512",
                           store=tmp_path)
    assert other.format == "native" and "a cached verdict needs no forward" in other.summary()


@pytest.mark.skipif(not format_runs("int8", torch.float32), reason="inductor does not run here")
def test_a_format_that_fails_leaves_the_model_native(tmp_path, monkeypatch):
    model, ids, logits = _model_and_ids()
    monkeypatch.setattr(weight_choice, "int8_runs_fast", lambda: True)
    monkeypatch.setattr(weight_choice, "MAX_KL", -1.0)  # nothing passes
    monkeypatch.setattr(weight_choice, "candidates", lambda *args: ("int8", "native"))
    choice = choose_weights(model, ids, key="tiny", capability="AVX512", store=tmp_path)
    assert choice.format == "native" and not choice.verdicts[0].passed
    assert "int8: KL" in choice.summary() and "(over KL -1)" in choice.summary()
    assert _linear_kinds(model) == {PackedLinear}  # the native decode layout, no int8 layer
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, logits, atol=1e-5, rtol=1e-5)
    # the failed verdict is cached too: the next load decides native without a forward
    monkeypatch.setattr("sfi.eval.fidelity.next_token_log_probs", None)
    again = choose_weights(_model_and_ids()[0], ids, key="tiny", capability="AVX512",
                           store=tmp_path)
    assert again.format == "native" and not again.measured


def test_without_text_to_check_with_auto_keeps_native(tmp_path, monkeypatch):
    model, _, _ = _model_and_ids()
    monkeypatch.setattr(weight_choice, "MIN_SAVING", 0.0)
    monkeypatch.setattr(weight_choice, "candidates", lambda *args: ("fp16", "native"))
    choice = choose_weights(model, None, key="tiny", capability="AVX2", store=tmp_path)
    assert choice.format == "native" and "fp16: not checked (no essays" in choice.summary()
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not format_runs("int8", torch.float32), reason="inductor does not run here")
def test_int8_where_it_would_be_slow_is_passed_over_unmeasured(tmp_path, monkeypatch):
    """On AVX2 without sfi's kernel the int8 product reads ~1.3 GB/s: never chosen."""
    model, ids, _ = _model_and_ids()
    monkeypatch.setattr(weight_choice, "int8_runs_fast", lambda: False)
    monkeypatch.setattr(weight_choice, "candidates", lambda *args: ("int8", "native"))
    choice = choose_weights(model, ids, key="tiny", capability="AVX2", store=tmp_path)
    assert choice.format == "native" and not choice.verdicts and not choice.measured
    assert "int8: slow here: sfi's int8 kernel does not run" in choice.summary()


def test_a_format_that_saves_too_few_bytes_is_passed_over(tmp_path, monkeypatch):
    """fp16 stores only weights of 4M elements and more: none of a tiny model's."""
    model, ids, _ = _model_and_ids()
    monkeypatch.setattr(weight_choice, "candidates", lambda *args: ("fp16", "native"))
    choice = choose_weights(model, ids, key="tiny", capability="AVX2", store=tmp_path)
    assert choice.format == "native" and not choice.verdicts
    assert "fp16: saves 0% of the weight bytes (< 25%)" in choice.summary()


def test_a_cache_entry_that_is_not_a_verdict_is_measured_again(tmp_path, monkeypatch):
    model, ids, _ = _model_and_ids()
    monkeypatch.setattr(weight_choice, "MIN_SAVING", 0.0)
    monkeypatch.setattr(weight_choice, "candidates", lambda *args: ("fp16", "native"))
    first = choose_weights(model, ids, key="tiny", capability="AVX2", store=tmp_path)
    (entry,) = tmp_path.iterdir()
    entry.write_text("{not json")
    second = choose_weights(_model_and_ids()[0], ids, key="tiny", capability="AVX2",
                            store=tmp_path)
    assert first.measured and second.measured and second.verdicts == first.verdicts


@pytest.mark.model
def test_load_says_what_auto_chose(tmp_path, monkeypatch, caplog, smol_tokenizer):
    """``sfi.load`` with the default weights: the format is the choice's, said in one notice,
    and kept on the model; on a GPU-less CPU machine whatever the CPU is."""
    import sfi

    monkeypatch.setenv("SFI_CACHE_DIR", str(tmp_path))
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    with caplog.at_level(logging.WARNING, logger="sfi"):
        loaded, _ = sfi.load(str(folder), compile=False)
    choice = loaded.sfi_weight_choice
    assert loaded.sfi_weights == choice.format
    assert choice.format in candidates(torch.backends.cpu.get_cpu_capability(), 1)
    assert choice.summary() in caplog.text
    native, _ = sfi.load(str(folder), weights="native", compile=False)
    assert native.sfi_weights == "native" and not hasattr(native, "sfi_weight_choice")
    batched, _ = sfi.load(str(folder), batch=4, compile=False)
    assert batched.sfi_weights == "native"
    with pytest.raises(sfi.SFIError, match="batch must be at least 1"):
        sfi.load(str(folder), batch=0)


@pytest.mark.skipif(not format_runs("int8", torch.float32), reason="inductor does not run here")
def test_a_failed_format_puts_tied_weights_back_tied(tmp_path, monkeypatch):
    from conftest import tied_tiny_qwen2

    model, ids, logits = tied_tiny_qwen2()
    monkeypatch.setattr(weight_choice, "int8_runs_fast", lambda: True)
    monkeypatch.setattr(weight_choice, "MAX_KL", -1.0)
    monkeypatch.setattr(weight_choice, "candidates", lambda *args: ("int8", "native"))
    choice = choose_weights(model, ids, key="tied", capability="AVX512", store=tmp_path)
    assert choice.format == "native"
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, logits, atol=1e-5, rtol=1e-5)
    assert isinstance(model.lm_head, PackedLinear)  # native decode layout, a copy of the table
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_a_check_that_cannot_run_leaves_native_and_says_why(tmp_path, monkeypatch):
    model, ids, logits = _model_and_ids()
    monkeypatch.setattr(weight_choice, "MIN_SAVING", 0.0)
    monkeypatch.setattr(weight_choice, "candidates", lambda *args: ("fp16", "native"))

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("not enough memory")

    monkeypatch.setattr("sfi.eval.fidelity.weight_fidelity", out_of_memory)
    choice = choose_weights(model, ids, key="tiny", capability="AVX2", store=tmp_path)
    assert choice.format == "native" and not choice.verdicts
    assert "fp16: not checked (RuntimeError: not enough memory)" in choice.summary()
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, logits, atol=1e-5, rtol=1e-5)
