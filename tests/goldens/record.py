"""Record (or recompute) the golden outputs that pin sfi's behaviour across refactors.

``python tests/goldens/record.py`` rewrites ``tests/goldens/*.json``; ``tests/test_goldens.py``
recomputes the same things and compares them. Every run uses the paper preset of the Selector
explicitly, so that changing the library's default does not move these outputs.

Recorded (default model, SmolLM2-135M-Instruct, fp32, CPU):
- ``generate``: ``sfi.generate`` for a padded batch of two essay prompts (sfi and full), and one
  sampled sequence with a seed;
- ``eval``: ``run_eval`` rows (outputs, scores, retention, fidelity KL) on one short sample
  of two tasks plus fidelity, for every method of ``sfi eval``;
- ``engine``: the server engine's replies for four pre-queued requests (greedy, seeded
  sampling, full attention, a stop string) decoded as one continuous batch;
- ``selector``: the paper Selector's top-K positions on fixed random evidence.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent
METHODS = ["full", "sfi", "sfi+snapkv", "sfi+tova", "sfi+h2o", "sfi+quest", "sfi+streamingllm",
           "streamingllm", "snapkv", "pyramidkv", "h2o", "tova", "quest"]


def paper_config(**overrides: Any):
    """The paper preset with ``overrides`` (the paper's defaults)."""
    from sfi import SFIConfig

    preset = getattr(SFIConfig, "paper", None)
    return preset(**overrides) if preset is not None else SFIConfig(**overrides)


def essay_prompts(tokenizer, lengths: tuple[int, ...]) -> list[str]:
    from sfi.texts import essays

    ids = tokenizer(essays(), add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids[3000 * i: 3000 * i + n]) for i, n in enumerate(lengths)]


def record_generate(model, tokenizer) -> dict[str, Any]:
    import sfi

    prompts = essay_prompts(tokenizer, (700, 900))
    config = paper_config(k_head=None, k_fraction=0.15, recent=64)
    out: dict[str, Any] = {}
    for mode in ("sfi", "full"):
        results = sfi.generate(model, tokenizer, prompts, mode=mode, max_new_tokens=40,
                               config=config if mode == "sfi" else None)
        out[f"batch_{mode}"] = [{"tokens": r.token_ids, "text": r.text,
                                 "finish_reason": r.finish_reason,
                                 "stats": r.stats.to_dict()} for r in results]
    sampled = sfi.generate(model, tokenizer, prompts[1], config=config, max_new_tokens=32,
                           temperature=0.8, top_p=0.9, seed=7)
    out["sampled_sfi"] = {"tokens": sampled.token_ids, "stats": sampled.stats.to_dict()}
    return out


def record_eval(model, tokenizer) -> list[dict[str, Any]]:
    from sfi.eval.runner import run_eval

    rows = run_eval(model, tokenizer, ["passkey", "niah", "fidelity"], [1024], METHODS, [0.3],
                    samples=1, fidelity_tokens=48, base=paper_config())
    return [r.to_dict() for r in rows]


def record_engine(model, tokenizer) -> list[dict[str, Any]]:
    from sfi.server.engine import Engine
    from sfi.server.requests import GenerationRequest

    prompts = essay_prompts(tokenizer, (600, 800, 500, 700))
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    config = paper_config(k_head=None, k_fraction=0.2, recent=64)
    requests = [
        GenerationRequest(prompt_ids=ids[0], max_tokens=24),
        GenerationRequest(prompt_ids=ids[1], max_tokens=30, temperature=0.7, top_p=0.95, seed=3),
        GenerationRequest(prompt_ids=ids[2], max_tokens=20, mode="full", temperature=0.9,
                          seed=11),
        GenerationRequest(prompt_ids=ids[3], max_tokens=40, stop=("."," and")),
    ]
    engine = Engine(model, tokenizer, config, max_batch=3)
    for request in requests:
        engine.submit(request)
    engine.start()
    try:
        deadline = 300.0
        import time

        start = time.time()
        while not all(r.done for r in requests):
            if time.time() - start > deadline:
                raise RuntimeError("the engine did not finish the golden requests")
            time.sleep(0.05)
    finally:
        engine.stop()
    return [{"tokens": r.tokens, "text": r.text, "finish_reason": r.finish_reason,
             "stats": r.stats.to_dict() if r.stats is not None else None} for r in requests]


def record_selector() -> list[list[list[int]]]:
    from sfi.core.scorers import Evidence
    from sfi.core.selector import SFISelector, top_k_positions

    out = []
    for seed, (heads, rows, t) in enumerate(((4, 3, 300), (2, 16, 257), (8, 1, 513))):
        gen = torch.Generator().manual_seed(seed)
        b = 2
        logits = torch.randn(b, heads, rows, t, generator=gen) * 3
        norms = torch.rand(b, heads, t, generator=gen) * 4 + 0.5
        lo = torch.tensor([4, 10])
        hi = torch.tensor([t - 64, t - 80])
        positions = torch.arange(t)
        candidates = (positions[None] >= lo[:, None]) & (positions[None] < hi[:, None])
        evidence = Evidence(logits=logits, key_norms=norms, candidates=candidates, lo=lo, hi=hi,
                            layer_idx=0, queries=rows)
        scores = SFISelector(paper_config()).score(evidence)
        chosen, _ = top_k_positions(scores, candidates, torch.tensor([40, 23]))
        out.append(chosen.tolist())
    return out


def compute(part: str, model=None, tokenizer=None) -> Any:
    if part == "selector":
        return record_selector()
    return {"generate": record_generate, "eval": record_eval,
            "engine": record_engine}[part](model, tokenizer)


PARTS = ("generate", "eval", "engine", "selector")


def main(parts: list[str]) -> None:
    import sfi

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = sfi.load("default", weights="native")
    for part in parts or PARTS:
        value = compute(part, model, tokenizer)
        (HERE / f"{part}.json").write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {part}.json")


if __name__ == "__main__":
    main(sys.argv[1:])
