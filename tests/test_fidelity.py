"""Teacher-forced fidelity: zero divergence at full budget, real divergence with a small one."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from sfi import SFIConfig
from sfi.eval.fidelity import teacher_forced_fidelity


def test_full_budget_is_exact_and_small_budget_is_not():
    model = tiny_model("qwen3")
    ids = torch.randint(0, 256, (1, 140), generator=torch.Generator().manual_seed(3))
    methods = {
        "everything": SFIConfig(sink=2, recent=8, k_head=1000, force_sparse=True,
                                trigger="fixed", period=5),
        "tiny": SFIConfig.paper(sink=2, recent=4, k_head=4, force_sparse=True,
                                trigger="fixed", period=5),
    }
    everything, tiny = teacher_forced_fidelity(model, ids, context=100, methods=methods,
                                               window=8)
    assert everything.tokens == tiny.tokens == 40
    assert everything.kl_mean < 1e-6 and everything.top1 == 1.0
    assert abs(everything.ppl - everything.ppl_full) < 1e-3 * everything.ppl_full
    assert tiny.kl_mean > 1e-4 and tiny.fast_retention < 0.2
    assert tiny.fast_retention < tiny.retention < 1.0  # slow steps read everything
    assert tiny.slow_steps == [5, 10, 15, 20, 25, 30, 35]  # every 5th fed token refreshes
    assert tiny.refresh_reasons["period"] == len(tiny.slow_steps)
    assert len(tiny.kl_per_step) == 40
    assert max(tiny.kl_per_step) == pytest.approx(tiny.kl_max, abs=1e-6)
    # a slow step attends densely: only the KV that earlier fast steps perturbed differs
    fast = [kl for i, kl in enumerate(tiny.kl_per_step) if i and i not in tiny.slow_steps]
    mean_fast = sum(fast) / len(fast)
    assert all(tiny.kl_per_step[i] < 0.1 * mean_fast for i in tiny.slow_steps)
