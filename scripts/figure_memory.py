"""The README's figure: what one fast step of the demo reads, layer by layer.

Run as ``.venv/bin/python scripts/figure_memory.py [out.png]`` (default
``docs/img/memory.png``; about a minute on 2 cores): the demo's document (``sfi demo``'s seed,
about 7,500 tokens, a fact hidden in it) is prefilled through a ``SlowFastCache`` with the
default preset at K = 15% of the context, the question is answered, and the positions in the
last fast step's memory are drawn for every layer (KV head 0): the sinks, the selected pages
and the recent window, with the hidden sentence marked. The figure's numbers (context, K,
fraction read) are those of that run.
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from sfi.cli.demo import DEMO_SEED
from sfi.core.config import SFIConfig
from sfi.decoding.decode import continue_greedy
from sfi.decoding.prefill import PREFILL_CHUNK, prefill
from sfi.eval.tasks import make_sample
from sfi.hf.facts import eos_token_ids
from sfi.hf.methods import build_cache
from sfi.hf.slab import SlabLayer
from sfi.models import load

out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/memory.png")
model, tokenizer = load("default", weights="native")
sample = make_sample("niah", tokenizer, 7500, DEMO_SEED)
config = SFIConfig.from_preset("default", k_fraction=0.15)
ids = torch.tensor([sample.prompt_ids])
length = ids.shape[1]

# where the hidden sentence lies, in tokens
start_char = sample.text.index(sample.needles[0])
end_char = start_char + len(sample.needles[0])
offsets = tokenizer(sample.text, return_offsets_mapping=True,
                    add_special_tokens=False)["offset_mapping"]
fact = [i for i, (a, b) in enumerate(offsets) if b > start_char and a < end_char]

with torch.inference_mode():
    cache = build_cache(model, tokenizer, "sfi", config=config, capacity=length + 16)
    head = length - config.evidence_window
    cache.prompt_continues = True  # the question's last W tokens make the first selection
    prefill(model, cache, ids[:, :head], start=0, chunk=PREFILL_CHUNK)
    cache.prompt_continues = False
    answer = continue_greedy(model, cache, ids, head, sample.max_new_tokens,
                             eos_token_ids(model, tokenizer))
text = tokenizer.decode(answer, skip_special_tokens=True).strip()
layers = [layer.layer_idx for layer in cache.layers if isinstance(layer, SlabLayer)]
total = length + len(answer)
recent_from = total - config.recent - 1
k = config.budget(length)

fig, ax = plt.subplots(figsize=(9, 4.2))
ax.axvspan(min(fact), max(fact) + 1, color="tab:red", alpha=0.7, lw=0, zorder=3,
           label=f"hidden sentence (positions {min(fact)}-{max(fact)})")
for index, layer_idx in enumerate(layers):
    positions = cache.selected_positions(layer_idx, 0)[0].tolist() + list(range(config.sink))
    ax.scatter(positions, [index] * len(positions), s=1.5, marker="s", color="tab:blue",
               lw=0, label="sinks and selected pages" if index == 0 else None)
ax.axvspan(recent_from, total, color="tab:green", alpha=0.3, lw=0,
           label=f"recent window ({config.recent} + new tokens)")
read = cache.stats().fast_read_fraction
ax.set_xlim(0, total)
ax.set_ylim(-1, len(layers))
ax.set_xlabel("position in the context (tokens)")
ax.set_ylabel("layer (KV head 0)")
ax.set_title(f"What a fast step reads: {total} tokens of context, K = {k} per head, "
             f"{read:.0%} of the context per step\n(the answer under SFI: {text!r})",
             fontsize=10)
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)
fig.tight_layout()
out.parent.mkdir(parents=True, exist_ok=True)
fig.savefig(out, dpi=120)
cache.close()
print(f"wrote {out}: answer {text!r}, fact at tokens {min(fact)}-{max(fact)}, read {read:.1%}")
