"""SFI inside a running vLLM engine: exact with a budget that covers the context, fast steps
that read only their slot, mixed and reused batches, every process, and the same tokens as the
transformers path (``sfi.generate``) with the same configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from conftest import COPY, COVERAGE, DEVICE, ENGINE, NEXT, PINNED, SENTENCE, SFI, generate

from sfi.vllm import backend
from sfi.vllm.backend import SFIImpl, SFIMetadata
from sfi.vllm.requests import FAST

EVERYTHING = replace(SFI, k_head=4096, force_sparse=True)  # K covers every context here


def stats():
    requests = backend.book()
    assert requests is not None, "the SFI backend never ran"
    return requests.stats


def test_the_backend_is_installed(smol):
    """Every stock backend of this platform that vLLM can import (CPU_ATTN here; FLASH_ATTN and
    TRITON_ATTN on CUDA) resolves to SFI's wrapper of it."""
    import importlib
    from importlib.metadata import entry_points

    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert any(e.value == "sfi.vllm:register" for e in entry_points(group="vllm.general_plugins"))
    platform = "cpu" if current_platform.is_cpu() else "cuda"
    wrapped = []
    for name, module, stock_name, _, _ in backend.WRAPPED[platform]:
        try:
            stock = getattr(importlib.import_module(module), stock_name)
        except ImportError:  # a kernel this build lacks: vLLM cannot pick it either
            continue
        chosen = AttentionBackendEnum[name].get_class()
        assert chosen.__module__ == backend.__name__ and issubclass(chosen, stock), name
        assert chosen is getattr(backend, f"SFI{stock_name}")
        wrapped.append(name)
    assert wrapped, f"no {platform} attention backend was wrapped"


def test_a_budget_covering_the_context_reproduces_stock_vllm(smol, essay_prompts):
    stock = generate(smol, essay_prompts, None)
    assert backend.book() is None  # switched off: the stock metadata, untouched
    exact = generate(smol, essay_prompts, EVERYTHING)
    assert exact == stock
    assert stats().rows["fast"] >= 3 * 25 and stats().rows["slow"] >= 3


def test_a_small_budget_runs_fast_steps_and_changes_the_output(smol, essay_prompts):
    stock = generate(smol, essay_prompts, None)
    small = generate(smol, essay_prompts, SFI)
    assert stats().rows["fast"] >= 3 * 25
    assert small != stock  # K = 128 of 700-1,500 tokens: not full attention any more


@contextmanager
def poisoned_fast_steps() -> Iterator[list[str]]:
    """Fill the vLLM cache blocks of every row with noise before each all-fast step: a fast
    step must not read them (its slot holds all it needs); a later slow step reads them."""
    original = SFIImpl.forward
    poisoned: list[str] = []

    def forward(self, layer, query, key, value, kv_cache, md, output, *args, **kwargs):
        if isinstance(md, SFIMetadata) and all(p.kind == FAST for p in md.step.plans):
            bs = kv_cache.shape[2]
            for plan in md.step.plans:
                blocks = md.block_table[plan.row][: -(-plan.total // bs)].long()
                kv_cache[blocks] = torch.randn_like(kv_cache[blocks]) * 10
            poisoned.append(layer.layer_name)
        return original(self, layer, query, key, value, kv_cache, md, output, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SFIImpl, "forward", forward)
        yield poisoned


def test_fast_steps_read_only_their_slot(smol, essay_prompts):
    prompt = essay_prompts[:1]
    never_refresh = replace(SFI, trigger="bootstrap")
    clean = {c: generate(smol, prompt, c, max_tokens=24) for c in (never_refresh, SFI)}
    with poisoned_fast_steps() as poisoned:
        # without a refresh, nothing reads vLLM's cache after the prompt: the same tokens
        assert generate(smol, prompt, never_refresh, max_tokens=24) == clean[never_refresh]
        assert len(poisoned) >= 20 * 30  # every layer of every fast step
        # a slow step (every 8 steps) reads the poisoned cache densely: the tokens change
        assert generate(smol, prompt, SFI, max_tokens=24) != clean[SFI]


def test_mixed_batches_and_reused_slots_equal_requests_alone(smol, essay_prompts, tokenizer):
    short = tokenizer("The capital of France is")["input_ids"]
    prompts = [essay_prompts[0], short, essay_prompts[1], essay_prompts[2], short,
               essay_prompts[0][:900]]
    alone = [generate(smol, [p], SFI)[0] for p in prompts]
    together = generate(smol, prompts, SFI)  # 6 requests through 4 slots
    s = stats()
    assert together == alone
    assert s.mixed_steps > 0  # dense (short prompt) and fast rows in one step
    assert s.requests == 6 and s.slots_reused >= 2


def test_a_slow_steps_refreshes_are_selected_together(smol, essay_prompts):
    """A slow row's refreshes wait for the step's last layer and are selected in one call over
    all layers (the transformers path's ``StackingRebuilder``); a first selection, read fast at
    its own step, is made in each layer as it runs."""
    import sfi.core.overlap

    original = sfi.core.overlap.select_groups
    calls: list[int] = []

    def counting(groups, evidence, k, *args):
        calls.append(len(k))  # rows selected in this call
        return original(groups, evidence, k, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sfi.core.overlap, "select_groups", counting)
        generate(smol, essay_prompts[:1], SFI, max_tokens=24)
    layers, slow = len(backend.book().layers), stats().rows["slow"]
    assert slow >= 2  # a fixed period of 8
    assert calls.count(1) == layers  # the first selection: one call per layer
    assert calls.count(layers) == slow and len(calls) == layers + slow


@pytest.fixture(scope="module")
def full_48(smol, essay_prompts):
    """The default model's transformers path and its texts, and each essay prompt's 48 greedy
    tokens under stock vLLM and under transformers' full attention."""
    import sfi

    model, tokenizer = sfi.load("default", weights="native")  # as vLLM runs it
    texts = [tokenizer.decode(prompt) for prompt in essay_prompts]
    assert [tokenizer(text)["input_ids"] for text in texts] == essay_prompts
    full = [list(sfi.generate(model, tokenizer, text, max_new_tokens=48, mode="full").token_ids)
            for text in texts]
    return model, tokenizer, texts, generate(smol, essay_prompts, None, max_tokens=48), full


@pytest.mark.parametrize("config", [SFI, SENTENCE, COVERAGE, COPY, NEXT, PINNED],
                         ids=["fixed", "sentence", "sentence+coverage", "coverage_copy",
                              "coverage_next", "pins+hysteresis+dense"])
def test_same_tokens_as_the_transformers_path(smol, essay_prompts, full_48, config):
    """Where stock vLLM and transformers' full attention agree, vLLM + SFI and sfi.generate
    agree with the same configuration (the sentence trigger sees the same input tokens). On
    CPU the two engines agree on all three prompts; on a GPU (sfi.generate on the CPU as the
    reference) on those where stock vLLM's numerics give the same greedy tokens."""
    import sfi

    model, tokenizer, texts, stock, fulls = full_48
    ours = generate(smol, essay_prompts, config, max_tokens=48)
    reasons = dict(stats().reasons)
    agreeing = 0
    for text, full, vllm_full, vllm_sfi in zip(texts, fulls, stock, ours):
        if full != vllm_full and DEVICE != "cpu":
            continue
        assert full == vllm_full
        agreeing += 1
        slow_fast = sfi.generate(model, tokenizer, text, max_new_tokens=48, config=config)
        assert list(slow_fast.token_ids) == vllm_sfi
        # (the probes refresh often at K = 128: a third of the steps on the first prompt)
        assert slow_fast.stats.fast_steps >= (20 if config.coverage_layers else 30)
    assert agreeing >= (3 if DEVICE == "cpu" else 1)
    assert sum(reasons.values()) > 3  # refreshes beyond the three first selections
    if config.trigger == "sentence" and not config.coverage_layers:
        assert reasons.get("sentence", 0) + reasons.get("interval", 0) >= 3
    if config.coverage_layers:
        assert reasons.get("coverage", 0) >= 3  # the probes flagged memories, as sfi's did


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy")


@contextmanager
def host_reads_per_step() -> Iterator[list[tuple[SFIMetadata, list[str]]]]:
    """Each SFI step's metadata and the reads of a tensor's values into Python that sfi's
    code makes during it (on a GPU each waits for the device, which vLLM's async scheduling
    would otherwise keep busy)."""
    from sfi.vllm import planning

    steps: list[tuple[SFIMetadata, list[str]]] = []
    plan_step = planning.plan_step

    def counted(md):
        steps.append((md, []))
        return plan_step(md)

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            caller = f"{frame.f_globals.get('__name__', '')}.{frame.f_code.co_name}"
            # (sfi.vllm.metadata.on_host reads vLLM's host copies, refusing device tensors)
            if steps and caller.startswith("sfi.") and not caller.endswith(".on_host"):
                steps[-1][1].append(f"{caller}: {name}")
            return original(self, *args, **kwargs)
        return read

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planning, "plan_step", counted)
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, counting(name))
        yield steps


def test_a_fast_step_reads_the_device_once(smol, essay_prompts):
    """A step in which every row is fast, probes included, reads the device into Python once
    (the decisions' inputs: input tokens, request keys, the probes' flags), whatever the
    batch and the number of probe layers."""
    with host_reads_per_step() as steps:
        generate(smol, essay_prompts, COVERAGE, max_tokens=24)
    fast = [reads for md, reads in steps
            if md.step.plans and all(p.kind == FAST for p in md.step.plans)]
    assert len(fast) >= 5 and stats().reasons.get("coverage", 0) >= 1  # probes flagged
    assert all(len(reads) == 1 for reads in fast), fast[0]


TP_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == '__main__':
    folder, engine, prompts = json.loads(sys.stdin.read())
    llm = LLM(model=folder, tensor_parallel_size=2, distributed_executor_backend='mp', **engine)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate([{'prompt_token_ids': p} for p in prompts], params, use_tqdm=False)
    print('TOKENS', json.dumps([list(o.outputs[0].token_ids) for o in out]))
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="two CPU processes; on a GPU machine, two GPUs")
def test_tensor_parallel_ranks_decide_as_one_rank(tmp_path_factory, tokenizer, essay_prompts):
    """Two tensor-parallel ranks (one KV head each) give the tokens of one rank holding both,
    with the coverage probes on and flagging: every rank ORs the ranks' flags before it
    decides, so the ranks' slow/fast decisions are one rank's. A stock multi-process engine
    (engine core and both workers in processes of their own) loads the plugin from
    ``SFI_VLLM``."""
    from conftest import close_engine, make_engine, save_tiny

    folder = save_tiny("qwen2", tmp_path_factory.mktemp("tp"), tokenizer)
    prompts = essay_prompts[:2]
    one = make_engine(folder)
    try:
        expected = generate(one, prompts, COVERAGE)
        reasons = dict(stats().reasons)
    finally:
        close_engine(one)
    assert reasons.get("coverage", 0) >= 2, reasons  # the probes flag, so ranks could diverge
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank (one NUMA node here)
    env["SFI_VLLM"] = ",".join(f"{name}={getattr(COVERAGE, name)}" for name in (
        "k_head", "recent", "refresh_interval", "min_refresh_gap", "coverage_layers", "min_skip",
        "min_gain"))
    done = subprocess.run([sys.executable, "-c", TP_SCRIPT],
                          input=json.dumps([str(folder), ENGINE, prompts]),
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert lines, done.stderr[-3000:]
    assert json.loads(lines[0][len("TOKENS "):]) == expected


def test_what_sfi_cannot_run_under_is_refused_by_name():
    """Pipeline parallelism, speculative decoding and micro-batching are refused (at engine
    start with SFI_VLLM set, or at the first step after :func:`sfi.vllm.configure`), naming
    the flag."""
    from types import SimpleNamespace as Config

    from sfi.vllm.builder import refuse_unsupported

    def engine(pipeline: int = 1, speculative: object = None, dbo: bool = False) -> Config:
        return Config(cache_config=Config(enable_prefix_caching=False, cache_dtype="auto"),
                      parallel_config=Config(decode_context_parallel_size=1,
                                             pipeline_parallel_size=pipeline,
                                             enable_dbo=dbo, ubatch_size=0),
                      speculative_config=speculative)

    refuse_unsupported(engine())
    with pytest.raises(RuntimeError, match=r"pipeline parallelism.*--pipeline-parallel-size 1"):
        refuse_unsupported(engine(pipeline=2))
    with pytest.raises(RuntimeError, match="speculative decoding"):
        refuse_unsupported(engine(speculative=Config(method="ngram")))
    with pytest.raises(RuntimeError, match=r"micro-batching .*--enable-dbo"):
        refuse_unsupported(engine(dbo=True))


def test_uninstall_puts_the_stock_model_classes_back():
    """install() replaces the registry's entries of the token architectures with recording
    classes that keep the entry they replaced; uninstall() puts exactly those back."""
    from vllm.model_executor.models import ModelRegistry

    from sfi.vllm import backend

    backend.install()
    try:
        entries = {arch: ModelRegistry.models[arch] for arch in backend.TOKEN_ARCHITECTURES
                   if arch in ModelRegistry.models}
        assert entries and all(hasattr(e.model_cls, backend.STOCK_ENTRY)
                               for e in entries.values())
        backend.install()  # a second install changes nothing
        assert all(ModelRegistry.models[a] is e for a, e in entries.items())
        backend.uninstall()
        for arch, entry in entries.items():
            stock = ModelRegistry.models[arch]
            assert stock is getattr(entry.model_cls, backend.STOCK_ENTRY)
            assert hasattr(stock, "module_name")  # vLLM's own lazy entry
    finally:
        backend.install()  # as the session's other tests expect it

