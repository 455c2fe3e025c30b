"""Exact mode's round-length controller, measured in one process: each row's own acceptance and a
verify time fitted against the positions it verifies (``sfi.draft_length.DraftLength``, the
default) against the controller before it (the rows' pooled acceptance, one verify time for
every gamma: an exponential average of the verifies measured).

    .venv/bin/python scripts/draft_length_ab.py [context] [batch] [reps] [--always-draft]
        [--model=NAME]

The default model unless ``--model`` names another (``qwen2.5-0.5b``), real essays (``sfi
bench``'s ids), greedy, 48 timed tokens per run. Each rep runs full attention (transformers'
``DynamicCache``, and sfi's own slab with every step dense: ``sfi`` with ``min_skip`` past the
context, the dense step exact mode falls back to), then exact mode under each controller (the
prompt's KV computed once and copied into each run's cache), and prints tokens/s, the ratio to
the rep's full run, the acceptance, tokens per verify, the mean gamma, the dense steps and
whether the tokens equal full attention's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from exact_ab import setup  # (this folder)

import sfi.exact
from sfi.bench.throughput import measure_cell
from sfi.draft_length import DraftLength, expected_tokens


class PooledConstant(DraftLength):
    """The controller before, approximately: the mean of the rows' acceptances (it pooled
    the rows' counts under one prior instead), one verify time for every gamma."""

    verify_s: float | None = None

    def rate(self, gamma: int, acceptances: Sequence[float]) -> float:
        pooled = sum(acceptances) / len(acceptances)
        return expected_tokens(gamma, pooled) / (gamma * self.draft_s + self.verify_s)

    def record_round(self, gamma: int, draft_s: float, verify_s: float) -> None:
        self.verify_s = self._mix(self.verify_s, verify_s)
        super().record_round(gamma, draft_s, verify_s)


CONTROLLERS = {"pooled, constant verify": PooledConstant, "per row, fitted verify": DraftLength}


def main() -> None:
    run = setup()
    model, tokenizer, config = run.model, run.tokenizer, run.config
    ids, prefix = run.ids, run.prefix
    common, context = run.common, run.context
    for rep in range(run.reps):
        tokens: dict[str, torch.Tensor] = {}
        full = measure_cell(model, tokenizer, "full", config, ids, prefix, tokens=tokens,
                            **common)
        dense = measure_cell(model, tokenizer, "sfi", replace(config, min_skip=10 * context),
                             ids, prefix, **common)
        print(f"rep {rep}: full {full.decode_tok_s:.2f} tok/s, slab dense "
              f"{dense.decode_tok_s:.2f} tok/s", flush=True)
        order = list(CONTROLLERS.items())
        for name, controller in order if rep % 2 == 0 else order[::-1]:
            sfi.exact.DraftLength = controller
            try:
                row = measure_cell(model, tokenizer, "sfi-exact", config, ids, prefix,
                                   tokens=tokens, **common)
            finally:
                sfi.exact.DraftLength = DraftLength
            print(f"rep {rep}: {name}: {row.decode_tok_s:.2f} tok/s, "
                  f"{row.decode_tok_s / full.decode_tok_s:.2f}x full, "
                  f"{row.decode_tok_s / dense.decode_tok_s:.2f}x slab dense, acceptance "
                  f"{row.acceptance:.2f}, {row.tokens_per_verify:.2f} tokens/verify, mean gamma "
                  f"{row.mean_draft:.2f}, dense steps {row.exact_dense_steps}, same tokens as "
                  f"full: {row.same_tokens_as_full}", flush=True)


if __name__ == "__main__":
    main()
