"""The throughput benchmark's output, and the decode weight layout it relies on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model

from sfi import SFIConfig, SFIError
from sfi.bench.throughput import (
    MODES,
    estimate_bytes,
    kv_bytes_per_entry,
    run_bench,
    weight_bytes,
)
from sfi.layout import prefer_decode_layout

ROW_FIELDS = {"mode", "context", "batch", "decode_tok_s", "fast_step_ms", "slow_step_ms",
              "slow_fraction", "speedup_vs_full", "floor_ms"}


def test_bench_json_schema_on_a_tiny_model(tmp_path, smol_tokenizer):
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    plot = tmp_path / "bench.png"
    result = subprocess.run(
        [sys.executable, "-m", "sfi.cli", "bench", "--model", str(folder), "--contexts", "48,96",
         "--batch", "1,2", "--new-tokens", "4", "--sink", "2", "--k-head", "8", "--recent", "8",
         "--evidence-window", "4", "--json", "--plot", str(plot)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["bandwidth_gb_s"] > 0 and out["skipped"] == []
    rows = out["rows"]
    assert len(rows) == 2 * 2 * len(MODES)
    for row in rows:
        assert set(row) >= ROW_FIELDS
        assert row["decode_tok_s"] > 0 and row["floor_ms"] > 0
        if row["mode"].startswith("sfi"):
            assert row["fast_step_ms"] is not None
        else:
            assert row["fast_step_ms"] is None and row["slow_fraction"] == 0
        if row["mode"] == "full":
            assert row["speedup_vs_full"] == 1.0
    assert {r["mode"] for r in rows if r["mode"] == "sfi-fast-only" and r["slow_fraction"] == 0}
    assert plot.stat().st_size > 1000


def test_bench_rejects_bad_contexts():
    result = subprocess.run([sys.executable, "-m", "sfi.cli", "bench", "--contexts", "0"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "positive integers" in result.stderr


def test_bench_needs_synthetic_kv_beyond_the_model_context(smol_tokenizer):
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    with pytest.raises(SFIError, match="use --synthetic-kv"):
        run_bench(model, smol_tokenizer, contexts=[4000], batches=[1], new_tokens=2,
                  config=SFIConfig())


def test_floor_accounting():
    model = tiny_model("qwen2")
    embed = model.model.embed_tokens.weight.numel() * 4
    total = sum(p.numel() * 4 for p in model.parameters())
    assert weight_bytes(model) == total - embed  # untied: the embedding table is not streamed
    assert kv_bytes_per_entry(model) == 2 * 2 * 3 * 16 * 4
    assert estimate_bytes(model, 100, 2) == kv_bytes_per_entry(model) * 100 * 2 * 3


def test_decode_layout_changes_strides_not_results(smol_tokenizer):
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, like SmolLM2
    ids = torch.randint(0, 1000, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    changed = prefer_decode_layout(model)
    assert changed == 2 * 4 + 1  # q, o, gate, up of two layers (out >= in) and lm_head
    assert model.lm_head.weight.stride() == (1, model.lm_head.weight.shape[0])
    assert model.model.embed_tokens.weight.is_contiguous()  # the embedding keeps its layout
    mlp = model.model.layers[0].mlp
    assert mlp.down_proj.weight.is_contiguous()  # out < in stays as it was
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
