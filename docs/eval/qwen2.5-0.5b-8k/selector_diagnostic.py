"""Which Selector stage drops the needle? One Qwen 8K passkey prefill, SFI variants at C = 15%."""
from dataclasses import replace

import torch

import sfi
from sfi.cache import SlowFastCache
from sfi.eval.methods import budget_tokens, sfi_config_for
from sfi.eval.runner import greedy_continue
from sfi.eval.tasks import make_sample
from sfi.prefix import SharedPrefill
from sfi.scorers.registry import make_scorer

m, t = sfi.load("qwen2.5-0.5b")
for task in ("passkey", "niah_multikey"):
    s = make_sample(task, t, 8192, 0)
    ids = torch.tensor([s.prompt_ids])
    enc = t(s.text, add_special_tokens=False, return_offsets_mapping=True)
    answer = s.answers[0]
    needle = next(n for n in s.needles if answer in n)
    at = s.text.index(needle)
    span = [i for i, (a, b) in enumerate(enc["offset_mapping"])
            if a >= at and b <= at + len(needle)]
    digits = [i for i in span if t.decode([s.prompt_ids[i]]).strip().isdigit()]
    pre = SharedPrefill(m, ids[:, :-32])
    base = sfi_config_for(budget_tokens(0.15, s.context))
    variants = {
        "sfi (defaults)": (base, "sfi"),
        "no soft-NMS": (replace(base, nms_strength=0.0), "sfi"),
        "no prior (lambda=0)": (replace(base, lambda_cap_single=0.0, lambda_cap_multi=0.0),
                                "sfi"),
        "evidence only": (replace(base, lambda_cap_single=0.0, lambda_cap_multi=0.0,
                                  nms_strength=0.0), "sfi"),
        "sfi+snapkv": (base, "snapkv"),
    }
    print(task, "answer", answer, "digits at", digits, "K =", base.k_head, flush=True)
    for name, (cfg, scorer) in variants.items():
        c = SlowFastCache(m, cfg, tokenizer=t, scorer=make_scorer(scorer, cfg))
        out = t.decode(greedy_continue(m, c, pre, ids, 12, {t.eos_token_id}))
        cover = []
        for layer in range(len(c.layers)):
            sel = c.selected_positions(layer, 0)
            hits = sum(int(torch.isin(torch.tensor(digits), sel[h]).sum())
                       for h in range(sel.shape[0]))
            cover.append(hits / (len(digits) * sel.shape[0]))
        share = sum(cover) / len(cover)
        print(f"  {name:22s} output {out!r:16s} needle digits selected: {share:.0%} "
              "of (layer, head) slots", flush=True)
