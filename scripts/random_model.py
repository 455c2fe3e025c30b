"""Save a random-weight model with the shape of a real one, for throughput runs at lengths the
packaged models do not reach (``make gpu-check``) or of models whose KV outweighs their weights
(``smollm2-360m``: at 32K its fp32 KV is 2.7 GB against 1.4 GB of weights): decode speed depends
on the shape only.

    python scripts/random_model.py qwen3-4b out/qwen3-4b-random [--device cuda]
        [--tokenizer FOLDER]

The tokenizer is the packaged model's of the same vocabulary (Qwen2.5's for the Qwen shapes,
Qwen3 shares it; SmolLM2-135M's for ``smollm2-360m``), or the one saved in ``--tokenizer
FOLDER`` on a machine without the packaged model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# Shapes of public configs (hidden, intermediate, layers, heads, KV heads, head size, vocab).
SHAPES = {
    # (the packaged Qwen2.5-Coder-0.5B-Instruct's own config: its output layer is not tied)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         rope_theta=1_000_000.0, tie_word_embeddings=False,
                         use_sliding_window=False),
    # SmolLM2-360M-Instruct's config (Llama, grouped 3:1), with a longer RoPE range
    "smollm2-360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5, head_dim=64,
                         vocab_size=49152, rope_theta=100_000.0, tie_word_embeddings=True,
                         rms_norm_eps=1e-5),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, rope_theta=1_000_000.0, tie_word_embeddings=True),
}


def save_random_model(shape: str, folder: Path, max_positions: int, device: str,
                      tokenizer: Path | None = None) -> Path:
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    from sfi.models import load_tokenizer

    kind = (LlamaConfig if shape.startswith("smollm2") else
            Qwen2Config if shape.startswith("qwen2") else Qwen3Config)
    config = kind(max_position_embeddings=max_positions, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok = (AutoTokenizer.from_pretrained(tokenizer) if tokenizer is not None
           else load_tokenizer("smollm2" if shape.startswith("smollm2") else "qwen2.5-0.5b"))
    tok.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--max-positions", type=int, default=131072 + 1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a folder holding a Qwen2.5 tokenizer (default: the packaged one)")
    args = parser.parse_args()
    if (args.folder / "config.json").exists():
        print(f"{args.folder} exists; kept")
        return
    print(save_random_model(args.shape, args.folder, args.max_positions, args.device,
                            args.tokenizer))


if __name__ == "__main__":
    main()
