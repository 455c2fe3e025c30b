"""SFI's metadata builder over a stand-in stock builder: what no CPU engine reaches (vLLM 0.33's
FlashAttention builder on CUDA keeps its FA3 scheduler metadata in one persistent buffer when it
expects full CUDA graphs; the CPU builder keeps none), and how the builder answers vLLM's CUDA
graph question with SFI off and on at engine start."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace as Namespace

import pytest
import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport

from sfi import SFIConfig
from sfi.vllm import configure
from sfi.vllm.builder import SFIBuilder


@dataclass
class StockMetadata:
    seq_lens: torch.Tensor
    scheduler_metadata: torch.Tensor
    softmax_segm_output: torch.Tensor


class StockBuilder:
    """Builds as FlashAttention's builder does under full CUDA graphs: each build writes its
    schedule into the builder's one buffer and returns a view of it; the scratch buffer of
    Triton's builder is shared by every build on purpose."""

    def __init__(self, vllm_config: Namespace) -> None:
        self.vllm_config = vllm_config
        self.scheduler_metadata = torch.zeros(8, dtype=torch.int32)
        self.softmax_segm_output = torch.zeros(4)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: object, kv_cache_spec: object
                              ) -> AttentionCGSupport:
        return AttentionCGSupport.UNIFORM_BATCH

    def build(self, common_prefix_len: int, common: Namespace, fast_build: bool = False
              ) -> StockMetadata:
        n = len(common.seq_lens)
        self.scheduler_metadata[:n] = common.seq_lens
        self.scheduler_metadata[n:] = 0
        return StockMetadata(common.seq_lens, self.scheduler_metadata[:n],
                             self.softmax_segm_output)


class Builder(SFIBuilder, StockBuilder):
    pass


def engine_config(graphs: CUDAGraphMode = CUDAGraphMode.NONE) -> Namespace:
    return Namespace(cache_config=Namespace(enable_prefix_caching=False, cache_dtype="auto"),
                     parallel_config=Namespace(decode_context_parallel_size=1,
                                               pipeline_parallel_size=1),
                     speculative_config=None,
                     compilation_config=Namespace(cudagraph_mode=graphs))


@pytest.fixture
def sfi_off():
    configure(None)
    yield
    configure(None)


def test_each_part_keeps_its_own_scheduler_metadata(sfi_off):
    """A mixed step builds its dense and fast parts with one builder: the first part's
    schedule must survive the second build (it would be a view the second overwrites)."""
    builder = Builder(engine_config())
    dense = builder.build_stock(Namespace(seq_lens=torch.tensor([700, 900, 40])))
    fast = builder.build_stock(Namespace(seq_lens=torch.tensor([251])))
    assert dense.scheduler_metadata.tolist() == [700, 900, 40]
    assert fast.scheduler_metadata.tolist() == [251]
    assert dense.softmax_segm_output is builder.softmax_segm_output  # scratch: shared as stock
    stock = StockBuilder.build(builder, 0, Namespace(seq_lens=torch.tensor([3])))
    assert stock.scheduler_metadata.data_ptr() == builder.scheduler_metadata.data_ptr()


def test_cuda_graphs_are_stocks_with_sfi_off_at_engine_start(sfi_off):
    """With SFI off when vLLM asks (engine start), the engine may capture what stock vLLM
    captures (a stock engine timed under the plugin is stock); with SFI on, nothing."""
    assert Builder.get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_BATCH
    configure(SFIConfig(coverage_layers=0, trigger="fixed", period=8))
    assert Builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER


def test_switching_sfi_on_under_full_cuda_graphs_is_refused(sfi_off):
    """An engine that started with SFI off may replay whole steps from CUDA graphs, where SFI's
    plan cannot run: switching SFI on there is refused by name, not silently skipped."""
    builder = Builder(engine_config(CUDAGraphMode.FULL_AND_PIECEWISE))
    builder.kv_cache_spec = Namespace(sliding_window=None)
    common = Namespace(num_reqs=1, seq_lens=torch.tensor([12]))
    assert builder.build(0, common).seq_lens.tolist() == [12]  # SFI off: stock
    configure(SFIConfig(coverage_layers=0, trigger="fixed", period=8))
    with pytest.raises(RuntimeError, match=r"switched on .* before the engine starts"):
        builder.build(0, common)


def test_slot_records_belong_to_the_book_that_planned_them():
    """Serials count per book: a new configuration's book starts them again, so an impl's
    per-slot records (selection, norms, page bounds) must not outlive the book."""
    from sfi.core.scorers.registry import make_scorer
    from sfi.vllm.impl import SFIImpl, SlotRecord
    from sfi.vllm.requests import RequestBook, slot_capacity

    config = SFIConfig(trigger="fixed", period=8, coverage_layers=0)
    impl = SFIImpl()
    step = Namespace(builder=Namespace(blocks_per_slot=lambda requests: 2))
    cache, query = torch.zeros(4, 2, 16, 8), torch.zeros(3, 4, 4)
    first, second = (RequestBook(config, 2, slot_capacity(config, 256),
                                 make_scorer("sfi", config)) for _ in range(2))
    impl._ensure_buffers(first, step, cache, query)
    impl.records[0] = SlotRecord(request=0, selected=torch.zeros(2, 3, dtype=torch.long))
    impl._ensure_buffers(first, step, cache, query)
    assert 0 in impl.records  # the same book's next step keeps them
    impl._ensure_buffers(second, step, cache, query)
    assert impl.records == {}  # request 0 of the new book is not the old book's request 0


def test_a_step_whose_refreshes_were_never_packed_is_refused():
    """The slow rows' refreshes are packed after the step's last layer; if that layer never ran
    with SFI's metadata, the next step refuses to plan (its fast rows would read stale slots)."""
    from sfi.core.overlap import StackingRebuilder
    from sfi.core.scorers.registry import make_scorer
    from sfi.vllm.planning import check_packed
    from sfi.vllm.requests import RequestBook, slot_capacity

    config = SFIConfig(trigger="fixed", period=8, coverage_layers=0)
    book = RequestBook(config, 2, slot_capacity(config, 256), make_scorer("sfi", config))
    first = StackingRebuilder()
    check_packed(book, first)
    check_packed(book, StackingRebuilder())  # the first packed everything: planned
    unpacked = Namespace(waiting=True, discard=lambda: None)
    book.step_rebuilder = unpacked
    with pytest.raises(RuntimeError, match="never packed"):
        check_packed(book, StackingRebuilder())


def test_layers_the_config_and_vllm_see_apart_are_refused():
    """The book places its probes and counts a fast step's reads over the layers the model's
    config gives SFI; vLLM decides per layer from its KV cache spec. Where they disagree the
    probes would be silently off: refused, naming the layers."""
    from sfi.vllm.builder import check_layers

    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    check_layers((1, 3), names[1::2], full=True)
    check_layers((1, 3), names[0::2], full=False)
    with pytest.raises(RuntimeError, match=r"model\.layers\.2\.self_attn\.attn the whole"):
        check_layers((1, 3), names[1:3], full=True)
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.self_attn\.attn a sliding"):
        check_layers((1, 3), names[:2], full=False)
    # whole-context layers split between two builders: each would plan the step
    with pytest.raises(RuntimeError, match=r"without layers \[3\].* several builders"):
        check_layers((1, 3), names[1:2], full=True)


@pytest.mark.parametrize("window, layer, match", [(128, 1, "sliding window"),
                                                  (None, 0, "whole context")])
def test_the_builder_checks_its_layers_against_the_config(sfi_off, window, layer, match):
    """Gemma 2's alternation, layer 1 full in the config: a builder that vLLM gives a window
    there, or the whole context at layer 0, is refused at its first SFI step (before any
    request book is made)."""
    config = engine_config()
    config.model_config = Namespace(hf_text_config=Namespace(
        num_hidden_layers=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"]))
    builder = Builder(config)
    builder.layer_names = [f"model.layers.{layer}.self_attn.attn"]
    builder.kv_cache_spec = Namespace(sliding_window=window)
    configure(SFIConfig(trigger="fixed", period=8, coverage_layers=0))
    with pytest.raises(RuntimeError, match=match):
        builder.build(0, Namespace(num_reqs=1, seq_lens=torch.tensor([12])))
    builder.layer_names = [f"model.layers.{1 - layer}.self_attn.attn"]  # the config's kind
    builder._engine_checked = False
    if window is not None:  # a sliding layer of the config: the model's own attention
        assert builder.build(0, Namespace(num_reqs=1, seq_lens=torch.tensor([12]))).seq_lens \
            .tolist() == [12]



@pytest.mark.parametrize("eager", [True, False])
def test_the_bench_warms_each_engine_up_untimed_before_its_first_cell(monkeypatch, default_path,
                                                                      tokenizer, eager):
    """A process's first vLLM decode runs slower throughout, so ``run_vllm_bench`` decodes a
    short request untimed on each engine before the first mode it times (eager: one engine,
    warmed with SFI off; compiled: vLLM + SFI's engine, then stock vLLM's); the rows hold
    only the timed cells' steps."""
    import sfi.bench.vllm as bench
    from sfi.core.decode_stats import DecodeStats
    from sfi.vllm import backend, settings

    decoded: list[tuple[int, bool]] = []  # (tokens of the first prompt, SFI on)

    def time_decode(llm, prompts, new_tokens, warmup):
        decoded.append((len(prompts[0]), settings.active_config() is not None))
        return [0.05 if len(prompts[0]) > bench.WARMUP_PROMPT else 1.0] * new_tokens

    monkeypatch.setattr(bench, "make_engine", lambda *args, **kwargs: object())
    monkeypatch.setattr(bench, "close_engine", lambda llm: None)
    monkeypatch.setattr(bench, "time_decode", time_decode)
    monkeypatch.setattr(backend, "book", lambda: Namespace(requests={}))  # no engine ran
    monkeypatch.setattr(bench, "cell_stats", lambda book, earlier: DecodeStats())
    result = bench.run_vllm_bench(default_path, None, tokenizer, contexts=[1024, 2048],
                                  batches=[1], new_tokens=3, config=SFIConfig(),
                                  own_engine=False, eager=eager)
    warm = bench.WARMUP_PROMPT
    if eager:
        assert decoded == [(warm, False), (1024, False), (1024, True), (2048, False),
                           (2048, True)]
    else:
        assert decoded == [(warm, True), (1024, True), (2048, True), (warm, False),
                           (1024, False), (2048, False)]
    assert [row["step_ms"] for row in result["rows"]] == [50.0] * 4  # the warm-ups' 1 s: out


def test_a_steps_metadata_is_frozen_once_planned():
    """The impl reads the plan and fills the step's work; nothing rewrites the metadata once
    it is planned."""
    from sfi.vllm.metadata import PlannedStep, SFIMetadata

    md = SFIMetadata(common=None, builder=None, book=None, key_column=torch.zeros(1),
                     query_lens=[1], seq_lens=[8], query_start=[0, 1],
                     block_table=torch.zeros(1, 1))
    md.input_ids = torch.tensor([3])  # before the plan: the model attaches its tokens
    md.step = PlannedStep(keys=[0], seq_lens=[8], plans=[], refreshing=[], recording=[])
    assert md.planned
    with pytest.raises(AttributeError, match="frozen once planned"):
        md.input_ids = None
    with pytest.raises(AttributeError, match="frozen once planned"):
        md.step = None
    md.work.probes.append("a probe layer")  # the step's scratch is an object of its own
