"""Save a random-weight model with the shape of a real one, for throughput runs at lengths the
packaged models do not reach (``make gpu-check``): decode speed depends on the shape only.

    python scripts/random_model.py qwen3-4b out/qwen3-4b-random [--device cuda]
        [--tokenizer FOLDER]

The tokenizer is Qwen2.5's (the packaged ``qwen2.5-0.5b``; Qwen3 shares its vocabulary), or the
one saved in ``--tokenizer FOLDER`` on a machine without the packaged model.
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
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, rope_theta=1_000_000.0, tie_word_embeddings=True),
}


def save_random_model(shape: str, folder: Path, max_positions: int, device: str,
                      tokenizer: Path | None = None) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen3Config

    from sfi.models import load_tokenizer

    kind = Qwen2Config if shape.startswith("qwen2") else Qwen3Config
    config = kind(max_position_embeddings=max_positions, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok = (AutoTokenizer.from_pretrained(tokenizer) if tokenizer is not None
           else load_tokenizer("qwen2.5-0.5b"))
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
