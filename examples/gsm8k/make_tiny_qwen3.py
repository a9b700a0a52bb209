"""A tiny random Qwen3 model that uses a real tokenizer, for smoke runs of the GSM8K example on CPU.

    python examples/gsm8k/make_tiny_qwen3.py --tokenizer ../shared/data/tokenizers/qwen3 --output_dir /tmp/tiny_qwen3

The vocabulary is the tokenizer's full size (`len(tokenizer)`, added tokens included, so every id the chat template
writes has an embedding row) and EOS/pad are the tokenizer's, so the rollout stops where a chat model would. The
tokenizer files are saved next to the weights: the directory alone works as `actor_rollout_ref.model.path`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import AutoTokenizer

from shardrl.data.chat import pad_id
from shardrl.models.tiny import make_tiny_checkpoint


def make_tiny_qwen3(tokenizer_dir: str | Path, out_dir: str | Path, hidden_size: int = 32,
                    max_position_embeddings: int = 1024, seed: int = 0) -> Path:
    """Save a 2-layer random Qwen3 with `tokenizer_dir`'s vocabulary and tokenizer files to `out_dir`."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    out_dir = make_tiny_checkpoint(
        "qwen3", out_dir, seed=seed, vocab_size=len(tokenizer), hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_id(tokenizer))
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True,
                        help="tokenizer directory (tokenizer.json, tokenizer_config.json)")
    parser.add_argument("--output_dir", required=True, help="model directory to write")
    parser.add_argument("--hidden_size", type=int, default=32)
    parser.add_argument("--max_position_embeddings", type=int, default=1024, help="longest prompt + response")
    args = parser.parse_args()
    out = make_tiny_qwen3(args.tokenizer, args.output_dir, args.hidden_size, args.max_position_embeddings)
    print(f"wrote a tiny random Qwen3 with the tokenizer of {args.tokenizer} to {out}")


if __name__ == "__main__":
    main()
