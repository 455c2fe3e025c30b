"""The throughput benchmark's output, and the decode weight layout it relies on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model
from test_cli import run_cli_here

from sfi import SFIConfig, SFIError
from sfi import load as sfi_load
from sfi.bench.formats import run_weight_formats
from sfi.bench.plots import exact_points
from sfi.bench.throughput import (
    MODES,
    benchmark_ids,
    estimate_bytes,
    kv_bytes_per_entry,
    run_bench,
    weight_bytes,
)
from sfi.eval.fidelity import next_token_log_probs, weight_fidelity
from sfi.weights import layout as weight_layout
from sfi.weights.layout import PackedLinear, prefer_decode_layout

ROW_FIELDS = {"mode", "context", "batch", "decode_tok_s", "fast_step_ms", "slow_step_ms",
              "slow_fraction", "fast_fraction", "speedup_vs_full", "floor_ms"}


def test_bench_json_schema_on_a_tiny_model(tmp_path, smol_tokenizer):
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    plot = tmp_path / "bench.png"
    result = subprocess.run(
        [sys.executable, "-m", "sfi.cli", "bench", "--model", str(folder), "--contexts", "48,96",
         "--batch", "1,2", "--max-new-tokens", "4", "--sink", "2", "--k-head", "8", "--recent", "8",
         "--evidence-window", "4", "--set", "min_skip=0", "--set",
         "min_gain=1", "--modes", ",".join(MODES), "--json",
         "--plot", str(plot), "--log-rows", str(tmp_path / "rows.jsonl"),
         "--prefill-cache", str(tmp_path / "prefills")],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["bandwidth_gb_s"] > 0 and out["skipped"] == []
    assert out["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    rows = out["rows"]
    assert len(rows) == 2 * 2 * len(MODES)
    logged = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["context"], r["batch"]) for r in logged] == \
        [(r["mode"], r["context"], r["batch"]) for r in rows]  # as measured, before the end
    assert len(list((tmp_path / "prefills").glob("*.pt"))) == 4  # one prefill per cell
    for row in rows:
        assert set(row) >= ROW_FIELDS
        assert row["decode_tok_s"] > 0 and row["floor_ms"] > 0
        if row["mode"] == "sfi-exact":  # full attention's tokens, measured as such
            assert row["same_tokens_as_full"] is True and 0 <= row["acceptance"] <= 1
            assert row["tokens_per_verify"] >= 1 or row["exact_dense_steps"] > 0
        elif row["mode"].startswith("sfi"):
            assert row["fast_step_ms"] is not None
            if row["mode"] == "sfi-fast-only":  # every row's every decode step, no probe
                assert row["fast_fraction"] == 1.0 and row["coverage_rate"] == 0.0
        else:
            assert row["fast_step_ms"] is None and row["slow_fraction"] == 0
        if row["mode"] == "full":
            assert row["speedup_vs_full"] == 1.0
    assert {r["mode"] for r in rows if r["mode"] == "sfi-fast-only" and r["slow_fraction"] == 0}
    assert plot.stat().st_size > 1000
    points = exact_points([out])  # one per cell: its fast/dense ratio against its speed-up
    assert len(points) == 4 and all(p["ratio"] > 0 and p["speedup"] > 0 for p in points)
    assert (tmp_path / "bench-exact.png").stat().st_size > 1000


def test_bench_reads_a_kept_prefill_back(tmp_path, smol_tokenizer, monkeypatch):
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    config = SFIConfig(sink=2, k_head=8, recent=8, evidence_window=4)
    bench = dict(contexts=[48], batches=[2], new_tokens=2, modes=["full"], config=config,
                 store=tmp_path)
    first = run_bench(model, smol_tokenizer, **bench)
    assert len(list(tmp_path.glob("*.pt"))) == 1

    def no_prefill(*args, **kwargs):
        raise AssertionError("the kept prefill was computed again")

    monkeypatch.setattr("sfi.decoding.prefix.prefix_kv", no_prefill)
    again = run_bench(model, smol_tokenizer, **bench)
    assert again["rows"][0]["mode"] == first["rows"][0]["mode"] == "full"


def test_bench_refuses_exact_mode_on_synthetic_kv(smol_tokenizer):
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    with pytest.raises(SFIError, match="sfi-exact needs real text"):
        run_bench(model, smol_tokenizer, contexts=[64], batches=[1], new_tokens=2,
                  config=SFIConfig(), modes=["full", "sfi-exact"], synthetic_kv=True)


def test_bench_rejects_bad_contexts():
    result = run_cli_here("bench", "--contexts", "0")
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


def test_the_floor_decides_sparse_with_the_engines_weights_term():
    """A sparse row's byte floor counts a fast step's entries only where the engine decodes
    sparse, which ``min_gain`` decides with the model's weights (W): at a context where the
    KV alone would pay but W + T does not, the floor is the dense step's."""
    from sfi.bench.throughput import _floor_ms
    from sfi.weights.layout import stored_weight_positions

    model = tiny_model("qwen2")
    w = stored_weight_positions(model)
    config = SFIConfig(sink=4, recent=8, k_head=16, min_skip=0, min_gain=1.5)
    short, long = 100, w + 200  # (W + T) >= 1.5 (W + 28) from T = W / 2 + 42 on
    assert w > 2 * (short - 42) and config.sparse_pays(short) and config.sparse_pays(long, w)
    assert not config.sparse_pays(short, w)
    for context, entries in ((short, short), (long, 28)):
        floor = weight_bytes(model) + kv_bytes_per_entry(model) * entries
        assert _floor_ms(model, config, context, 1, 1e-3, sparse=True) == round(floor / 1e3, 3)


def _tied_tiny_llama(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, like SmolLM2
    return model


def _logits(model):
    ids = torch.randint(0, 1000, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.skipif(not weight_layout.format_runs("native", torch.float32),
                    reason="no oneDNN packing on this CPU")
def test_decode_layout_packs_linears_without_changing_results(smol_tokenizer):
    model = _tied_tiny_llama(smol_tokenizer)
    embed = model.model.embed_tokens.weight.clone()
    dense = {name: m.weight.detach().clone() for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    before, state = _logits(model), model.state_dict()
    assert prefer_decode_layout(model) == 2 * 7 + 1  # every projection of two layers, lm_head
    packed_state = model.state_dict()  # a checkpoint of the packed model is complete
    assert packed_state.keys() == state.keys()
    assert all(torch.equal(packed_state[k], state[k]) for k in state)
    packed = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert packed.keys() == dense.keys()
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    for name, module in packed.items():  # the packed weight holds the same numbers
        assert torch.equal(module.weight, dense[name])
    assert torch.equal(model.model.embed_tokens.weight, embed)  # the embedding keeps its table
    assert weight_bytes(model) == sum(w.numel() * 4 for w in dense.values()) + sum(
        p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=1e-5)
    assert prefer_decode_layout(model) == 0  # nothing left to change


def test_decode_layout_transposes_wide_weights_without_onednn(smol_tokenizer, monkeypatch):
    monkeypatch.setattr(weight_layout, "format_runs", lambda weights, dtype: False)
    model = _tied_tiny_llama(smol_tokenizer)
    before = _logits(model)
    changed = prefer_decode_layout(model)
    assert changed == 2 * 4 + 1  # q, o, gate, up of two layers (out >= in) and lm_head
    assert model.lm_head.weight.stride() == (1, model.lm_head.weight.shape[0])
    assert model.model.embed_tokens.weight.is_contiguous()  # the embedding keeps its layout
    mlp = model.model.layers[0].mlp
    assert mlp.down_proj.weight.is_contiguous()  # out < in stays as it was
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=1e-5)


needs_bf16 = pytest.mark.skipif(not weight_layout.format_runs("bf16", torch.float32),
                                reason="bf16 weights need x86 with oneDNN")


@needs_bf16
def test_bf16_weights_approximate_the_linear_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(2, 3, 64)
    packed = PackedLinear(linear, "bf16")
    with torch.inference_mode():
        got, expected = packed(x), linear(x)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 96)
    error = (got - expected).abs().max() / expected.abs().max()
    assert 0 < error < 3e-2  # not exact, but close
    assert torch.equal(packed.weight, linear.weight.detach().bfloat16())
    assert packed.stored_bytes() == 96 * 64 * 2


def test_weight_formats_are_refused_by_name_where_they_cannot_run(monkeypatch):
    model = tiny_model("llama")
    with pytest.raises(SFIError, match="unknown weight format 'fp8'"):
        prefer_decode_layout(model, "fp8")
    monkeypatch.setattr(weight_layout, "format_runs", lambda weights, dtype: False)
    monkeypatch.setattr(weight_layout.platform, "machine", lambda: "aarch64")
    with pytest.raises(SFIError, match="weights='bf16' needs an x86 CPU"):
        prefer_decode_layout(model, "bf16")
    with pytest.raises(SFIError, match="needs device='cpu' and decode_layout=True"):
        sfi_load("default", decode_layout=False, weights="bf16")


@needs_bf16
def test_weight_formats_bench_in_one_run_with_their_fidelity(smol_tokenizer):
    def load_model(name):
        model = tiny_model("llama", vocab_size=len(smol_tokenizer))
        prefer_decode_layout(model, name)
        return model, smol_tokenizer

    result = run_weight_formats(load_model, ["native", "bf16"], fidelity_tokens=64,
                                contexts=[48], batches=[1], new_tokens=2,
                                config=SFIConfig(sink=2, k_head=8, recent=8, evidence_window=4,
                                                 min_skip=0, min_gain=1.0),
                                modes=["full", "sfi"], synthetic_kv=True)
    rows = result["rows"]
    assert [(r["weights"], r["mode"]) for r in rows] == [
        ("native", "full"), ("native", "sfi"), ("bf16", "full"), ("bf16", "sfi")]
    assert all(r["speedup_vs_native"] > 0 for r in rows)
    assert [r["speedup_vs_native"] for r in rows[:2]] == [1.0, 1.0]
    bytes_by = result["weight_bytes_by_format"]
    assert bytes_by["bf16"] < bytes_by["native"] * 0.6  # half, beside the fp32 norms
    (fidelity,) = result["fidelity"]
    assert fidelity["weights"] == "bf16" and fidelity["tokens"] == 63
    assert -1e-6 < fidelity["kl_mean"] <= fidelity["kl_max"] and fidelity["kl_max"] > 0
    assert 0 <= fidelity["top1"] <= 1 and fidelity["ppl"] != fidelity["ppl_native"]


def test_weight_fidelity_of_the_native_weights_is_perfect(smol_tokenizer):
    model = tiny_model("llama", vocab_size=len(smol_tokenizer))
    ids = benchmark_ids(smol_tokenizer, 40, 1)
    native = next_token_log_probs(model, ids)
    same = weight_fidelity("native", native, model, ids)
    assert same.kl_mean == pytest.approx(0, abs=1e-6) and same.top1 == 1.0
    assert same.ppl == pytest.approx(same.ppl_native)
    with pytest.raises(SFIError, match="ids must be"):
        weight_fidelity("native", native, model, ids[:, :-1])


def test_bench_refuses_an_unknown_weight_format():
    result = run_cli_here("bench", "--weights", "fp8")
    assert result.returncode == 2 and "--weights" in result.stderr and "fp8" in result.stderr


def test_checking_a_format_leaves_the_callers_random_stream_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    weight_layout.format_runs.__wrapped__("native", torch.float32)  # the uncached check
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("command, value, message", [
    ("generate", "fp8", "--weights: unknown fp8"),
    ("serve", "native,bf16", "--weights takes one format here"),
])
def test_weights_option_is_checked_before_loading(command, value, message):
    args = [command, "--weights", value]
    if command == "generate":
        args += ["--prompt", "hello"]
    result = run_cli_here(*args)
    assert result.returncode == 2 and message in result.stderr


@needs_bf16
def test_load_with_bf16_weights_packs_every_linear_layer_in_bf16():
    model, _ = sfi_load("default", weights="bf16")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 7 * model.config.num_hidden_layers + 1
    assert {m.format for m in packed} == {"bf16"}
    assert {m.packed_weight.dtype for m in packed} == {torch.bfloat16}
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the rest stays native


def test_the_engine_plot_has_a_line_per_engine_and_mode_in_each_batch(tmp_path, monkeypatch):
    import matplotlib.figure

    from sfi.bench.plots import plot_engines

    series = [("vllm", "vllm"), ("vllm", "vllm+sfi"), ("sfi", "full"), ("sfi", "sfi"),
              ("sfi", "sfi-fast-only"), ("llama.cpp", "Q4_1"), ("llama.cpp", "F32")]
    rows = [{"engine": e, "mode": m, "context": c, "batch": b, "decode_tok_s": 1.0 + c / 1e4}
            for e, m in series for c in (4096, 8192) for b in (1, 4)
            if e != "llama.cpp" or b == 1]
    drawn = []
    save = matplotlib.figure.Figure.savefig

    def record(fig, *args, **kwargs):
        drawn.extend([line.get_label() for line in ax.lines] for ax in fig.axes)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    plot_engines({"rows": rows, "device": "cpu"}, str(tmp_path / "engines.png"))
    assert (tmp_path / "engines.png").stat().st_size > 0
    assert drawn == [["vllm", "vllm+sfi", "sfi engine, full", "sfi engine, sfi",
                      "sfi engine, sfi-fast-only", "llama.cpp, Q4_1 weights",
                      "llama.cpp, F32 weights"],
                     ["vllm", "vllm+sfi", "sfi engine, full", "sfi engine, sfi",
                      "sfi engine, sfi-fast-only"]]


def test_a_llama_cpp_row_names_the_weights_its_gguf_stores():
    from sfi.bench.llama_cpp import gguf_weights
    from sfi.models import packaged_gguf

    gguf = packaged_gguf("default")
    if gguf is None:
        pytest.skip("the packaged SmolLM2 GGUF is not installed")
    assert gguf_weights(gguf) == "Q4_1"  # its matrices; norms and biases are F32 vectors


def test_llama_cpp_rows_run_each_flash_attention_setting_and_say_which(tmp_path, monkeypatch):
    from sfi.bench import throughput

    asked = []

    def times(gguf, prompt, new_tokens, warmup, threads, flash_attn=True):
        asked.append(flash_attn)
        return [0.05] * new_tokens

    monkeypatch.setattr(throughput, "decode_times", times)
    monkeypatch.setattr(throughput, "gguf_weights", lambda gguf: "Q8_0")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    model = tiny_model("llama")
    rows = [throughput.llama_cpp_row(model, gguf, list(range(40)), new_tokens=4, warmup=1,
                                     bandwidth=10.0, flash_attn=fa) for fa in (True, False)]
    assert asked == [True, False]
    assert [r.mode for r in rows] == ["llama.cpp Q8_0", "llama.cpp Q8_0 no-fa"]
    assert rows[0].decode_tok_s == pytest.approx(20.0)


def test_step_rates_count_the_rows_decode_steps():
    from sfi.bench.throughput import step_rates
    from sfi.core.decode_stats import DecodeStats

    stats = DecodeStats(fast_steps=5, slow_steps=2, dense_steps=1)
    stats.refresh_reasons.update(coverage=1, sentence=1)
    assert step_rates(stats) == (0.625, 0.125)
    assert step_rates(DecodeStats()) == (None, None) and step_rates(None) == (None, None)
