"""The evaluation harness: row schema, shared-prefill equivalence, report and plots, the CLI,
and the support-stability analysis."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from test_cli import run_cli, run_cli_here

from sfi.core.config import SFIConfig
from sfi.core.triggers import REFRESH_REASONS
from sfi.decoding.prefix import SharedPrefill
from sfi.errors import SFIError
from sfi.eval.figures import plot_all
from sfi.eval.report import markdown, merge_results, summarize
from sfi.eval.runner import greedy_continue, parse_runs, run_eval
from sfi.eval.stability import jaccard, support_stability
from sfi.eval.tasks import make_sample
from sfi.hf.eviction import EvictionCache
from sfi.hf.methods import budget_tokens, build_cache, parse_method, sfi_config_for

ROW_KEYS = {"task", "context", "prompt_tokens", "method", "budget", "capacity", "retention",
            "score", "sample"}


def test_eval_rows_summary_report_and_plots(tiny_llama_with_tokenizer, tmp_path):
    model, tok = tiny_llama_with_tokenizer
    methods = ["full", "sfi", "snapkv@0.5", "h2o", "quest", "sfi+quest"]
    rows = run_eval(model, tok, ["niah", "fidelity"], [400], methods, [0.3], samples=2,
                    fidelity_tokens=8)
    dicts = [r.to_dict() for r in rows]
    assert len(dicts) == 2 * 6 + 2 * 6  # niah: every method; fidelity: full + 5 compared
    for row in dicts:
        assert set(row) >= ROW_KEYS
        assert 0.0 <= row["score"] <= 100.0 and 0.0 < row["retention"] <= 1.0
        assert row["context"] == 400
    fidelity = [r for r in dicts if r["task"] == "fidelity"]
    assert all({"kl", "top1", "ppl"} <= set(r) for r in fidelity)
    assert {r["depth"] for r in dicts if r["task"] == "niah"} == {0.0, 1.0}
    by_method = {(r["method"], r["budget"]): r for r in dicts if r["task"] == "niah"}
    assert by_method[("full", 1.0)]["retention"] == 1.0
    assert by_method[("snapkv", 0.5)]["capacity"] == budget_tokens(0.5, 400)
    assert 0.25 < by_method[("h2o", 0.3)]["retention"] < 0.36
    assert {r["sample"] for r in dicts} == {0, 1}  # the samples' seeds
    for row in dicts:  # SFI's rows say why they refreshed; the others have no refreshes
        assert ("refresh_reasons" in row) == row["method"].startswith("sfi")
        assert row.get("refresh_reasons", {"bootstrap": 1}).get("bootstrap", 0) >= 1
    result = {"model": "tiny", "tasks": ["niah", "fidelity"], "contexts": [400], "samples": 2,
              "seed": 0, "rows": dicts}
    result["summary"] = summarize(dicts)
    merged = merge_results([result, {**result, "rows": [{**r, "sample": r["sample"] + 2}
                                                       for r in dicts]}])
    assert merged["samples"] == 4 and len(merged["rows"]) == 2 * len(dicts)
    rerun = [{**r, "score": 50.0} for r in dicts if r["task"] == "niah"]
    replaced = merge_results([result, {**result, "rows": rerun}])
    assert len(replaced["rows"]) == len(dicts)
    assert all(r["score"] == 50.0 for r in replaced["rows"] if r["task"] == "niah")
    assert next(e for e in merged["summary"] if e["label"] == "full")["samples"] == {
        "niah": 4, "fidelity": 4}
    assert {e["label"] for e in result["summary"]} == {
        "full", "sfi@0.3", "snapkv@0.5", "h2o@0.3", "quest@0.3", "sfi+quest@0.3"}
    plots = plot_all(result, tmp_path)
    assert {p.rsplit("/", 1)[1] for p in plots} == {"score_vs_budget.png", "niah_heatmap.png",
                                                    "fidelity_kl.png"}
    report = markdown(result, plots)
    assert ("| context | method | retention | niah | avg | 95% CI | vs full [95% CI] | top1 % | KL "
            "| ppl |") in report
    assert "| context | method | bootstrap | sentence | interval | period | coverage |" in report
    refreshes = next(e for e in result["summary"] if e["label"] == "sfi@0.3")["refreshes"]
    assert refreshes["bootstrap"] >= 1 and set(refreshes) == set(REFRESH_REASONS)


def test_generation_rows_read_each_text_with_full_attention(tiny_llama_with_tokenizer):
    """Full attention's own text reads as itself (ratio 1, agreement 100%, no departure);
    a covering SFI budget writes full attention's text; a small one reads like a text of its
    own; the summary and the report give the generation table."""
    from sfi.eval.runner import evaluate_sample
    from sfi.eval.tasks import GENERATION_TOKENS, make_sample

    model, tok = tiny_llama_with_tokenizer
    rows = []
    for index in range(2):
        sample = make_sample("generation", tok, 300, seed=index)
        assert sample.max_new_tokens == GENERATION_TOKENS and sample.answers == []
        sample.max_new_tokens = 24
        runs = [(parse_method("full"), 1.0), (parse_method("sfi"), 1.0),
                (parse_method("sfi"), 0.2)]
        rows += [r.to_dict() for r in evaluate_sample(model, tok, sample, index, runs,
                                                      base=SFIConfig(force_sparse=True))]
    by = {(r["method"], r["budget"], r["sample"]): r for r in rows}
    for index in range(2):
        full = by[("full", 1.0, index)]
        assert full["ppl"] == full["ppl_full"] and full["top1"] == 1.0 and full["score"] == 100
        assert "divergence" not in full and full["distinct"] == full["distinct_full"]
        assert by[("sfi", 1.0, index)]["output"] == full["output"]  # the budget covers all
        small = by[("sfi", 0.2, index)]
        assert small["retention"] < 0.9 and 0 < small["top1"] <= 1
    summary = summarize(rows)
    entries = {e["label"]: e for e in summary}
    assert entries["full"]["generation"]["ppl_ratio"] == 1.0
    assert entries["full"]["generation"]["identical"] == 2
    assert entries["full"]["average"] is None  # generation is not a retrieval task
    result = {"model": "tiny", "tasks": ["generation"], "contexts": [300], "samples": 2,
              "seed": 0, "summary": summary}
    assert "| 300 | full | 100.0 | 1.000 " in markdown(result, [])


def test_distinct_ngrams_and_first_divergence():
    from sfi.eval.generation import distinct_ngrams, first_divergence

    assert distinct_ngrams([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(4 / 5)
    assert distinct_ngrams([1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([5], [5]) is None


@pytest.mark.parametrize("name", ["full", "sfi", "sfi+snapkv", "snapkv", "h2o", "tova", "quest"])
def test_a_shared_prefill_continues_exactly_like_a_fresh_prefill(name, tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    sample = make_sample("niah", tok, 300, seed=0)
    ids = torch.tensor([sample.prompt_ids])
    method = parse_method(name)
    shared = SharedPrefill(model, ids[:, :-32], history=method.needs_history)
    cloned = build_cache(model, tok, method, budget=0.3, context=sample.context)
    tokens = greedy_continue(model, cloned, shared, ids, 12, eos=set())
    fresh = build_cache(model, tok, method, budget=0.3, context=sample.context)
    assert greedy_continue(model, fresh, None, ids, 12, eos=set()) == tokens
    if isinstance(cloned, EvictionCache):
        for a, b in zip(cloned.layers, fresh.layers):
            assert torch.equal(a.keep, b.keep)


def test_exact_mode_as_an_eval_method_answers_as_full_attention(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    methods = ["full", "sfi:exact", "sfi:exact:paper[k_head=16]"]
    rows = run_eval(model, tok, ["niah"], [400], methods, [0.1], samples=2,
                    overrides={"force_sparse": True, "draft_fallback": False, "draft_min": 4,
                               "draft_max": 4})
    outputs: dict[int, dict[str, str]] = {}
    for row in rows:
        outputs.setdefault(row.sample, {})[row.method] = row.output
        if row.method != "full":
            assert row.retention == 1.0 and 0.0 <= row.acceptance < 1.0  # drafts were rejected
    for by_method in outputs.values():
        assert set(by_method.values()) == {by_method["full"]}, by_method
    summary = {e["label"]: e for e in summarize([r.to_dict() for r in rows])}
    assert 0.0 <= summary["sfi:exact@0.1"]["acceptance"] < 1.0
    assert summary["sfi:exact@0.1"]["average"] == summary["full"]["average"]
    assert parse_method("sfi:exact:paper").preset == "paper"
    with pytest.raises(SFIError, match="drafter preset"):
        parse_method("sfi:exact:fastest")
    with pytest.raises(SFIError, match="by construction"):
        run_eval(model, tok, ["fidelity"], [400], ["sfi:exact"], [0.1], samples=1,
                 fidelity_tokens=8)


def test_method_names_and_budgets():
    runs = parse_runs(["full", "sfi", "snapkv@0.5", "sfi+tova"], [0.15, 0.2])
    assert [(m.name, b) for m, b in runs] == [
        ("full", 1.0), ("sfi", 0.15), ("sfi", 0.2), ("snapkv", 0.5), ("sfi+tova", 0.15),
        ("sfi+tova", 0.2)]
    assert budget_tokens(0.15, 4096) == 615 and budget_tokens(1024, 4096) == 1024
    config = sfi_config_for(615)
    assert (config.sink, config.recent, config.k_head) == (4, 256, 355)
    assert config.min_skip == 0  # held to its budget at every context, as the baselines are
    model = tiny_model("llama")
    named = build_cache(model, None, "sfi[trigger=fixed,min_skip=64]", budget=0.5, context=100)
    assert named.config.min_skip == 64 and named.config.k_head == 50 - 4 - 25
    assert build_cache(model, None, "sfi", budget=0.5, context=100,
                       overrides={"trigger": "fixed"}).config.min_skip == 0
    assert sfi_config_for(100).recent == 50
    for bad, message in ((["sfi+pyramidkv"], "own budget"), (["lru"], "unknown method"),
                         (["snapkv@half"], "must be a number")):
        with pytest.raises(SFIError, match=message):
            parse_runs(bad, [0.1])
    with pytest.raises(SFIError, match="whole"):
        budget_tokens(10.5, 100)
    with pytest.raises(SFIError, match="positive"):
        budget_tokens(-1, 100)


def test_sfi_at_default_runs_as_sfi_generate_does(tiny_llama_with_tokenizer):
    """``sfi@default`` takes no budget split: the config's K and its cost model, whose dense
    steps below the break-even a budgeted ``sfi@C`` turns off."""
    model, tok = tiny_llama_with_tokenizer
    runs = parse_runs(["full", "sfi@default", "sfi:paper@default"], [0.3])
    assert [(m.name, b) for m, b in runs] == [("full", 1.0), ("sfi", 0.0), ("sfi:paper", 0.0)]
    with pytest.raises(SFIError, match="needs a budget"):
        parse_runs(["snapkv@default"], [0.1])
    for zero in (["sfi@0"], ["sfi"]):  # 0 is no budget, not "as configured"
        with pytest.raises(SFIError, match="positive"):
            parse_runs(zero, [0.0])
    methods = ["full", "sfi[min_skip=10000]@default", "sfi@0.3"]  # break-even past the context
    rows = run_eval(model, tok, ["niah"], [400], methods, [0.3], samples=1)
    labels = {e["label"] for e in summarize([r.to_dict() for r in rows])}
    assert labels == {"full", "sfi[min_skip=10000]@default", "sfi@0.3"}
    default = next(r for r in rows if r.budget == 0.0)
    budgeted = next(r for r in rows if r.budget == 0.3)
    assert default.retention == 1.0 and default.slow_steps == 0  # every step dense
    assert budgeted.retention < 1.0  # held to its budget
    assert default.capacity == budgeted.prompt_tokens  # S + K + R, no more than the context
    # sparse, with the config's own K and R (a budget of 0.3 would keep 120 per head)
    rows = run_eval(model, tok, ["niah"], [400], [
        "sfi[k_head=8,recent=16,min_skip=0,min_gain=1,coverage_layers=0,trigger=bootstrap]"
        "@default"], [0.3], samples=1)
    (own,) = rows
    assert own.capacity == 4 + 8 + 16 and own.slow_steps == 0
    new = len(tok(own.output, add_special_tokens=False)["input_ids"]) + 1
    assert 28 / 400 <= own.fast_retention <= (28 + new) / own.prompt_tokens


def test_jaccard():
    a = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    b = torch.tensor([[1, 2, 3, 4], [3, 4, 5, 6]])
    assert jaccard(a, b).tolist() == pytest.approx([1.0, 2 / 6])


def test_stability_series_and_a_memory_that_holds_everything(tiny_llama_with_tokenizer):
    model, tok = tiny_llama_with_tokenizer
    sample = make_sample("fidelity", tok, 400, seed=1, continuation=40)
    ids = torch.tensor([sample.prompt_ids])
    from sfi import SFIConfig

    everything = SFIConfig(recent=16, k_head=None, k_fraction=1.0)
    result = support_stability(model, tok, ids, 400, everything, top_k=8)
    assert len(result.to_boundary) == len(result.captured) == len(result.consecutive) + 1 == 40
    assert all(0.0 <= j <= 1.0 for j in result.consecutive + result.to_boundary)
    assert all(abs(c - 1.0) < 1e-4 for c in result.captured)  # K covers the whole middle
    assert result.boundaries[0] == 0 and result.refreshes[0] == 0
    small = support_stability(model, tok, ids, 400, SFIConfig(recent=16, k_head=8), top_k=8)
    assert max(small.captured) < 1.0
    assert {"jaccard_within_sentence", "jaccard_across_boundary",
            "captured_mass_fast_steps"} <= set(small.summary)


@pytest.mark.model
def test_eval_and_analyze_commands(default_model, tmp_path):
    result = run_cli("eval", "--tasks", "passkey", "--contexts", "600", "--samples", "1",
                     "--methods", "full,sfi,tova@0.5", "--budgets", "0.3", "--json",
                     "--set", "nms_strength=0", "--tag", "no-nms", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert [(r["method"], r["budget"]) for r in out["rows"]] == [
        ("full:no-nms", 1.0), ("sfi:no-nms", 0.3), ("tova:no-nms", 0.5)]
    assert out["sfi_overrides"] == ["nms_strength=0"]
    assert list(out["configs"]) == ["sfi:no-nms"]  # what sfi ran, whatever the defaults become
    assert out["configs"]["sfi:no-nms"]["nms_strength"] == 0
    assert out["configs"]["sfi:no-nms"]["alpha"] == SFIConfig().alpha
    assert {"results.json", "report.md", "score_vs_budget.png"} <= {
        p.name for p in tmp_path.iterdir()}
    merged = run_cli("report", str(tmp_path / "results.json"), str(tmp_path / "results.json"),
                     "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr
    merged_result = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert len(merged_result["rows"]) == 3 and merged_result["configs"] == out["configs"]
    assert run_cli("report", str(tmp_path / "nope.json"), "--out", str(tmp_path)).returncode == 2
    assert {r["weights"] for r in out["rows"]} == {"native"}
    other = run_cli("eval", "--tasks", "passkey", "--contexts", "600", "--samples", "1",
                    "--methods", "full", "--weights", "bf16", "--out", str(tmp_path), "--resume")
    assert other.returncode == 2, other.stderr  # the journal's rows are native
    assert "not bf16" in " ".join(other.stderr.split())
    analysis = run_cli("analyze", "--context", "700", "--tokens", "24", "--top-k", "16",
                       "--json")
    assert analysis.returncode == 0, analysis.stderr
    summary = json.loads(analysis.stdout)["summary"]
    assert 0.0 < summary["captured_mass_fast_steps"] <= 1.0


@pytest.mark.parametrize("args, message", [
    (["eval", "--methods", "sfi+pyramidkv"], "own budget"),
    (["eval", "--tasks", "haystack"], "unknown haystack"),
    (["eval", "--budgets", "0"], "positive"),
    (["eval", "--contexts", "abc"], "comma-separated integers"),
    (["diagnose", "--task", "vt", "--depth", "0.5"], "vt has no depth"),
    (["diagnose", "--task", "niah", "--depth", "1.5"], "--depth must lie in [0, 1]"),
    (["eval", "--weights", "int4"], "--weights"),
    (["eval", "--weights", "native,int8"], "one format"),
])
def test_eval_bad_input_exits_with_a_message(args, message):
    result = run_cli_here(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_stored_prefill_is_read_back_and_continues_the_same(tiny_llama_with_tokenizer,
                                                               tmp_path):
    model, tok = tiny_llama_with_tokenizer
    sample = make_sample("niah", tok, 300, seed=1)
    ids = torch.tensor([sample.prompt_ids])
    first = SharedPrefill(model, ids[:, :-32], history=True, store=tmp_path)
    stored = list(tmp_path.iterdir())
    assert len(stored) == 1 and stored[0].suffix == ".pt"
    again = SharedPrefill(model, ids[:, :-32], history=True, store=tmp_path)
    for (k1, v1), (k2, v2) in zip(first.kv, again.kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert all(torch.equal(a, b) for a, b in zip(first.history, again.history))
    for name in ("sfi", "h2o"):
        method = parse_method(name)
        runs = [greedy_continue(model, build_cache(model, tok, method, budget=0.3,
                                                   context=sample.context), shared, ids, 8,
                                eos=set()) for shared in (first, again)]
        assert runs[0] == runs[1]
    other = SharedPrefill(model, ids[:, :-31], store=tmp_path)  # other ids: another entry
    assert other.length == ids.shape[1] - 31 and len(list(tmp_path.iterdir())) == 2


@pytest.mark.parametrize("other", ["int8", "bf16"])
def test_each_weight_format_keeps_its_own_prefill(other):
    from conftest import tiny_model

    from sfi.decoding.prefix import prefill_key
    from sfi.weights.layout import format_runs, prefer_decode_layout

    if not (format_runs("native", torch.float32) and format_runs(other, torch.float32)):
        pytest.skip(f"{other} does not run on this CPU")
    ids = torch.arange(20)[None]
    keys = []
    for weights in ("native", "native", other):
        model = tiny_model("llama")  # the same seeded weights each time
        prefer_decode_layout(model, weights)
        keys.append(prefill_key(model, ids))
    assert keys[0] == keys[1] != keys[2]  # packed and int8 layers keep weights in buffers


def test_bootstrap_intervals_cover_the_mean_and_pair_with_full():
    from sfi.eval.report import bootstrap_interval, summarize

    rows = []
    for sample in range(6):
        for task in ("passkey", "niah"):
            rows.append({"task": task, "context": 100, "method": "full", "budget": 1.0,
                         "retention": 1.0, "score": 100.0, "sample": sample})
            rows.append({"task": task, "context": 100, "method": "sfi", "budget": 0.1,
                         "retention": 0.1, "score": 100.0 if sample % 3 else 0.0,
                         "sample": sample})
    entries = {e["label"]: e for e in summarize(rows)}
    sfi_entry = entries["sfi@0.1"]
    low, high = sfi_entry["average_ci"]
    assert low < sfi_entry["average"] < high and low >= 0 and high <= 100
    assert sfi_entry["delta_full"] == round(sfi_entry["average"] - 100.0, 2)
    assert sfi_entry["delta_full_ci"][1] < 0  # it loses on the same samples, surely
    assert entries["full"]["average_ci"] == [100.0, 100.0] and "delta_full" not in entries["full"]
    assert bootstrap_interval({"passkey": {0: 50.0}}) is None  # one sample: no interval


def test_each_weight_format_is_its_own_row_paired_with_its_own_full():
    rows = []
    for weights, sfi_score in (("native", 100.0), ("int8", 0.0)):
        for sample in range(2):
            rows.append({"task": "passkey", "context": 100, "method": "full", "budget": 1.0,
                         "retention": 1.0, "score": 100.0 if weights == "native" else 50.0,
                         "sample": sample, "weights": weights})
            rows.append({"task": "passkey", "context": 100, "method": "sfi", "budget": 0.1,
                         "retention": 0.1, "score": sfi_score, "sample": sample,
                         "weights": weights})
    old = [{k: v for k, v in r.items() if k != "weights"} for r in rows[:4]]  # before weights
    run = {"model": "m", "tasks": ["passkey"], "contexts": [100], "samples": 2, "seed": 0}
    merged = merge_results([{**run, "rows": old}, {**run, "rows": rows[4:]}])
    entries = {e["label"]: e for e in merged["summary"]}
    assert list(entries) == ["full", "sfi@0.1", "full (int8)", "sfi@0.1 (int8)"]
    assert entries["sfi@0.1"]["delta_full"] == 0.0  # against native full
    assert entries["sfi@0.1 (int8)"]["delta_full"] == -50.0  # against int8 full
    assert "delta_full" not in entries["full (int8)"]
    assert "weights native, int8." in markdown(merged, [])


def test_long_answers_are_counted_item_by_item_against_full():
    rows = []
    for sample, (full, sfi) in enumerate([([True] * 6, [True] * 5 + [False]),
                                          ([True] * 5 + [False], [True] * 6)]):
        for method, items in (("full", full), ("sfi", sfi)):
            rows.append({"task": "codes6", "context": 100, "method": method,
                         "budget": 1.0 if method == "full" else 0.1, "retention": 1.0,
                         "score": 100 * sum(items) / 6, "sample": sample, "items": items})
    entries = {e["label"]: e for e in summarize(rows)}
    assert entries["sfi@0.1"]["items"] == {"found": 11, "asked": 12, "lost_vs_full": 1,
                                           "gained_vs_full": 1}
    assert entries["full"]["items"] == {"found": 11, "asked": 12}
    result = {"model": "m", "tasks": ["codes6"], "contexts": [100], "samples": 2, "seed": 0,
              "summary": summarize(rows)}
    assert "| 100 | sfi@0.1 | 11 / 12 | 1 | 1 |" in markdown(result, [])


@pytest.mark.model
def test_diagnose_reports_coverage_by_stage_and_captured_mass(default_model):
    from sfi.eval.diagnose import answer_positions, diagnose

    model, tok = default_model
    sample = make_sample("passkey", tok, 900, seed=0)
    spans = answer_positions(tok, sample)
    answer = sample.answers[0]
    assert answer in tok.decode([sample.prompt_ids[i] for i in spans[answer]])
    result = diagnose(model, tok, sample, 0, ["sfi:paper", "sfi:paper[page_size=16]"], 0.3)
    paper, _ = result.methods
    assert list(paper.token_coverage) == ["evidence", "fused", "nms", "exclusive", "selected"]
    for m in result.methods:
        assert all(0.0 <= v <= 1.0 for v in m.token_coverage.values())
        assert len(m.captured) == len(m.captured_min) > 0
        assert all(0.0 <= low <= mean <= 1.0 for low, mean in zip(m.captured_min, m.captured))
        assert m.stats["slow_steps"] >= 0 and 0.0 < m.retention <= 1.0
        assert len(m.step_kinds) == len(m.captured) and set(m.step_kinds) <= {"slow", "fast"}
        assert list(m.held_at_answer) == [answer]
        assert all(v is None or 0.0 <= v <= 1.0 for v in m.held_at_answer.values())
    # a budget covering the context holds every answer token at every stage
    whole = diagnose(model, tok, sample, 0, ["sfi:paper[recent=64,force_sparse=true]"],
                     2000).methods[0]
    assert whole.token_coverage["selected"] == 1.0 and min(whole.captured_min) > 0.999
    assert all(v is None or v == 1.0 for v in whole.held_at_answer.values())


def test_held_at_answer_reads_the_step_that_writes_the_answer(smol_tokenizer):
    from sfi.eval.diagnose import _held_at_answer

    tokens = smol_tokenizer("Codes: 4821, then 7710.", add_special_tokens=False)["input_ids"]
    first = next(j for j in range(len(tokens))
                 if "7" in smol_tokenizer.decode(tokens[: j + 1])[len("Codes: 4821, then"):])
    by_step = [{"4821": 0.1 * step, "7710": 0.01 * step} for step in range(len(tokens) - 1)]
    held = _held_at_answer(smol_tokenizer, tokens, {"4821": [3], "7710": [9], "5555": [1]},
                           by_step)
    assert held["7710"] == by_step[first - 1]["7710"]  # token j is written by step j - 1
    assert held["5555"] is None  # full attention never wrote it


@pytest.mark.model
def test_demo_answers_from_one_prefill_both_ways(default_model):
    from sfi.cli.demo import run_demo

    model, tok = default_model
    prefilled = []
    # (min_skip=0: a document this short would decode densely by default)
    result = run_demo(model, tok, context=1500, seed=0, answer_tokens=16,
                      config=SFIConfig.from_preset("default", k_fraction=0.15, min_skip=0,
                                                        min_gain=1.0),
                      on_prefill=lambda done, total: prefilled.append((done, total)))
    assert result.hidden in result.sample.text and result.question in result.sample.text
    assert prefilled[-1] == (result.prefill_tokens, result.prefill_tokens)
    # one prefill of the document serves both questions: they share its tokens
    assert result.prefill_tokens > 1300
    for side in ("full", "sfi"):
        assert result.correct(result.fact[side])  # this seed's fact is found by both
        longer = result.explanation[side]
        assert longer.mode == side and 0 < len(longer.token_ids) <= 16
        assert longer.seconds > 0 and longer.tokens_per_s > 0
    assert result.explanation["full"].read_fraction == 1.0
    assert 0.0 < result.explanation["sfi"].read_fraction < 1.0
    assert result.speedup > 0
    first = result.explanation["full"].token_ids
    assert result.agreeing_tokens == next(
        (i for i, (a, b) in enumerate(zip(first, result.explanation["sfi"].token_ids))
         if a != b), min(len(first), len(result.explanation["sfi"].token_ids)))


def test_shared_length_leaves_each_prompt_its_window():
    from sfi.cli.demo import _shared_length

    assert _shared_length([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], window=2) == 3
    assert _shared_length([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], window=2) == 4
    with pytest.raises(SFIError, match="share no document tokens"):
        _shared_length([1, 2, 3], [7, 8, 9], window=1)


def test_the_repetition_guard_bans_what_would_repeat_an_ngram_of_the_answer():
    from sfi.decoding.decode_step import repeated_ngram_tokens

    tokens = [1, 2, 3, 9, 1, 2]
    assert repeated_ngram_tokens(tokens, 3) == [3]  # 1 2 3 is there: 3 may not follow 1 2
    assert repeated_ngram_tokens(tokens, 4) == []  # no 4-gram starts 9 1 2
    assert repeated_ngram_tokens([5, 5], 1) == [5, 5] and repeated_ngram_tokens([], 2) == []
    assert repeated_ngram_tokens(tokens, 0) == []  # 0: no guard
