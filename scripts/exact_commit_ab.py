"""Exact mode's commit rule, measured in one process: each row its own accepted drafts (holes
where a row committed fewer, the default) against the batch's common prefix (no holes).

    .venv/bin/python scripts/exact_commit_ab.py [context] [batch] [reps] [--always-draft]

Default model, real essays (``sfi bench``'s ids), greedy, 48 timed tokens per run. Each rep
runs full attention, then exact mode with the common prefix, then with per-row commits (the
prompt's KV computed once and copied into each run's cache), and prints each run's tokens/s,
its ratio to the rep's full run, the per-row acceptance, tokens per verify, the dense steps
and the median draft step and verify; every exact run's tokens are checked against full
attention's.
"""

from __future__ import annotations

import statistics

import torch
from exact_ab import setup  # (this folder)

from sfi.bench.throughput import measure_cell
from sfi.draft_length import DraftLength
from sfi.exact import ExactDecoder

RULES = {"common prefix": min, "per row": max}
rounds: list[tuple[float, float]] = []  # each round's (draft step, verify) seconds
_record = DraftLength.record_round


def _recording(self, gamma, draft_s, verify_s):
    rounds.append((draft_s / gamma, verify_s))
    return _record(self, gamma, draft_s, verify_s)


DraftLength.record_round = _recording


def main() -> None:
    run = setup()
    model, tokenizer, config = run.model, run.tokenizer, run.config
    ids, prefix = run.ids, run.prefix
    common = run.common
    for rep in range(run.reps):
        tokens: dict[str, torch.Tensor] = {}
        full = measure_cell(model, tokenizer, "full", config, ids, prefix, tokens=tokens,
                            **common)
        print(f"rep {rep}: full {full.decode_tok_s:.2f} tok/s", flush=True)
        for name, rule in RULES.items():
            ExactDecoder.round_length = staticmethod(rule)
            rounds.clear()
            row = measure_cell(model, tokenizer, "sfi-exact", config, ids, prefix,
                               tokens=tokens, **common)
            print(f"rep {rep}: {name}: {row.decode_tok_s:.2f} tok/s, "
                  f"{row.decode_tok_s / full.decode_tok_s:.2f}x full, acceptance "
                  f"{row.acceptance:.2f}, {row.tokens_per_verify:.2f} tokens/verify, mean draft "
                  f"{row.mean_draft:.2f}, dense steps {row.exact_dense_steps}, same tokens as "
                  f"full: {row.same_tokens_as_full}; {len(rounds)} rounds, median draft step "
                  f"{1000 * statistics.median(d for d, _ in rounds):.0f} ms, verify "
                  f"{1000 * statistics.median(v for _, v in rounds):.0f} ms", flush=True)


if __name__ == "__main__":
    main()
