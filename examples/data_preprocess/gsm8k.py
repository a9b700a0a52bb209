"""Convert GSM8K jsonl files ({question, answer}) to shardrl/verl RL parquet files.

    python examples/data_preprocess/gsm8k.py --input_dir ../shared/data/gsm8k --output_dir ~/data/gsm8k

writes `train.parquet` and `test.parquet`. Each row: data_source "openai/gsm8k", prompt = one user message (the
question plus the instruction below), ability "math", reward_model {style "rule", ground_truth = the number after
"####" with thousands separators removed}, extra_info {split, index, question, answer}.

With `--tool` (verl's gsm8k tool-agent recipe shape, for `examples/gsm8k_tool/`): a system message that offers the
`code_interpreter` tool first, and `agent_name` "tool_agent".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TOOL_SYSTEM = ("You are a math expert. Solve the problem step by step. You may run Python code with the "
               "`code_interpreter` tool to compute; print() what you need to see. Put your final answer after "
               '"####".')
REPO_ROOT = Path(__file__).resolve().parents[2]


def extract_answer(answer: str) -> str:
    """The final number of a GSM8K worked solution: the text after its '####', without commas ("1,080" -> "1080")."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' marker: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def make_row(example: dict[str, str], index: int, split: str, tool: bool = False) -> dict[str, Any]:
    """One RL row from a GSM8K example (`tool`: the tool-agent variant)."""
    row = {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_answer(example["answer"])},
        "extra_info": {"split": split, "index": index, "question": example["question"], "answer": example["answer"]},
    }
    if tool:
        row["prompt"] = [{"role": "system", "content": TOOL_SYSTEM}, *row["prompt"]]
        row["agent_name"] = "tool_agent"  # the Python tool takes no per-sample arguments: no tools_kwargs
    return row


def convert(input_path: Path, output_path: Path, split: str, limit: int | None = None, tool: bool = False) -> int:
    """Convert the first `limit` (all if None) examples of a jsonl file; returns the number of rows written."""
    with input_path.open() as f:
        lines = [line for line in f if line.strip()][:limit]
    rows = [make_row(json.loads(line), index, split, tool) for index, line in enumerate(lines)]
    output_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), output_path)
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input_dir", type=Path, default=REPO_ROOT / "../shared/data/gsm8k",
                        help="folder with train.jsonl and test.jsonl (default: ../shared/data/gsm8k from the repo "
                             "root)")
    parser.add_argument("--output_dir", type=Path, default=Path("~/data/gsm8k"), help="where the parquet files go")
    parser.add_argument("--limit", type=int, default=None, help="convert only the first N examples of each split")
    parser.add_argument("--tool", action="store_true", help="rows for the tool agent (examples/gsm8k_tool)")
    args = parser.parse_args()
    input_dir, output_dir = args.input_dir.expanduser().resolve(), args.output_dir.expanduser()
    for split in ("train", "test"):
        source = input_dir / f"{split}.jsonl"
        if not source.is_file():
            raise SystemExit(f"--input_dir: {source} not found")
        count = convert(source, output_dir / f"{split}.parquet", split, args.limit, args.tool)
        print(f"wrote {count} rows to {output_dir / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
