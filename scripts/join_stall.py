"""The server's join stall, as a new user meets it: one stream of 200 tokens on the default
model, and 3K-token prompts joining it one after another; prints the longest gap between two
of the stream's tokens while each prompt joins (the engine in this process, its default limits
unless overridden).

    python scripts/join_stall.py [--joins 3] [--prefill-chunk 128] [--max-stall-ms 400]
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time

import sfi
from sfi.server.engine import Engine
from sfi.server.requests import GenerationRequest
from sfi.texts import essay


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--joins", type=int, default=3)
    parser.add_argument("--prefill-chunk", type=int, default=None)
    parser.add_argument("--max-stall-ms", type=float, default=None)
    parser.add_argument("--join-tokens", type=int, default=3000)
    args = parser.parse_args()
    sfi.runtime.keep_freed_memory()
    model, tokenizer = sfi.load("default", weights="native")
    limits = {}
    if args.prefill_chunk is not None:
        limits["prefill_chunk"] = args.prefill_chunk
    if args.max_stall_ms is not None:
        limits["max_stall"] = args.max_stall_ms / 1000
    engine = Engine(model, tokenizer, **limits)
    engine.start()
    text = essay(args.join_tokens + 1200, tokenizer)
    ids = tokenizer(text)["input_ids"]
    stream_times: list[float] = []
    finished = threading.Event()

    def on_stream(kind: str, _value: object) -> None:
        if kind == "delta":
            stream_times.append(time.perf_counter())
        else:
            finished.set()

    engine.submit(GenerationRequest(prompt_ids=ids[:1000], max_tokens=200, on_event=on_stream))
    while len(stream_times) < 10:
        time.sleep(0.01)
    joins: list[tuple[float, float]] = []
    for i in range(args.joins):
        first = threading.Event()
        sent = time.perf_counter()

        def on_join(kind: str, _value: object, first: threading.Event = first) -> None:
            first.set()

        engine.submit(GenerationRequest(prompt_ids=ids[200 + i: 200 + i + args.join_tokens],
                                        max_tokens=4, on_event=on_join))
        first.wait()
        joins.append((sent, time.perf_counter()))
        time.sleep(1.0)  # the stream runs alone for a while
    finished.wait()
    engine.stop()
    gaps = list(itertools.pairwise(stream_times))
    stalls = [max((b - a for a, b in gaps if a < end and b > sent), default=0.0)
              for sent, end in joins]
    during = [[round(1000 * (b - a)) for a, b in gaps if a < end and b > sent]
              for sent, end in joins]
    alone = sorted(b - a for a, b in gaps if not any(a < e and b > s for s, e in joins))
    print(json.dumps({
        "prefill_chunk": engine.prefill_chunk, "max_stall_ms": engine.max_stall * 1000,
        "join_tokens": args.join_tokens, "stream_tokens": len(stream_times),
        "join_stall_ms": [round(1000 * s) for s in stalls],
        "join_ms": [round(1000 * (e - s)) for s, e in joins],
        "gaps_while_joining_ms": during,
        "alone_step_ms_median": round(1000 * alone[len(alone) // 2]) if alone else None}))


if __name__ == "__main__":
    main()
