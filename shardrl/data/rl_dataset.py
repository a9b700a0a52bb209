"""Prompt datasets in verl's RL format and a resumable, seeded batch loader over them.

A row (parquet or jsonl) holds `data_source` (selects the reward function; verl's `data.reward_fn_key` may name
another column for it), `prompt` (chat messages), `ability`, `reward_model` (`{"style": ..., "ground_truth": ...}`)
and `extra_info` (free-form dict). Prompts are rendered with the tokenizer's chat template once, when the dataset is
built, so overlong prompts are found (filtered or reported) before training starts rather than at some later step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow.parquet as pq
import torch
from transformers import PreTrainedTokenizerBase

from shardrl.data.batch import Batch
from shardrl.data.chat import left_pad, pad_id, prompt_token_ids
from shardrl.errors import UserError, first_line

logger = logging.getLogger(__name__)

Truncation = Literal["error", "left", "right"]
TRUNCATION_MODES = ("error", "left", "right")


class DatasetError(UserError, ValueError):
    """A data file that cannot be used as it is; the message names the file (and row) and what to change."""


def read_rows(path: str | Path, required: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of a parquet or jsonl file as dicts, checking the file exists, has rows and has `required` columns."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"{path}: RL data file not found (data.train_files / data.val_files)")
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise DatasetError(f"{path}: not a readable parquet file ({first_line(err)}); write it again, e.g. "
                               f"with pandas' DataFrame.to_parquet") from None
        missing = [c for c in required if c not in table.column_names]
        if missing:
            raise DatasetError(f"{path}: missing column {missing[0]!r}; it has columns {table.column_names}")
        rows = table.to_pylist()
    elif path.suffix == ".jsonl":
        rows = []
        with path.open() as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DatasetError(f"{path} line {number}: not JSON ({err.msg}); one JSON object per "
                                       f"line") from None
                if not isinstance(row, dict):
                    raise DatasetError(f"{path} line {number}: a JSON {type(row).__name__}, not an object")
                rows.append(row)
        for number, row in enumerate(rows):
            missing = [c for c in required if c not in row]
            if missing:
                raise DatasetError(f"{path}: row {number} is missing column {missing[0]!r}; it has {sorted(row)}")
    else:
        raise DatasetError(f"{path}: unsupported suffix {path.suffix!r} for RL data; use .parquet or .jsonl")
    if not rows:
        raise DatasetError(f"{path}: the RL data file has no rows")
    return rows



class RLDataset:
    """Tokenized prompts with their reward fields, from one or more files (rows kept in file order).

    `data_source_key` (verl's `data.reward_fn_key`): the column that picks each row's reward function, required
    in place of `data_source` and carried into batches under its own name. `chat_template_kwargs` (verl's
    `data.apply_chat_template_kwargs`): extra arguments for rendering the prompts, see `prompt_token_ids`.
    `tools`: multi-turn tool schemas rendered into every prompt. Rows may carry `agent_name` (which agent loop runs
    them), kept as a column when any row has it.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_length: int = 1024,
        truncation: Truncation = "error",
        filter_overlong_prompts: bool = False,
        prompt_key: str = "prompt",
        max_samples: int = -1,
        data_source_key: str = "data_source",
        chat_template_kwargs: Mapping[str, Any] = {},
        tools: list[dict[str, Any]] | None = None,
        render_workers: int = 1,
        media_keys: Sequence[str] = ("images", "videos", "audios"),
        carried_columns: Sequence[str] = (),
    ) -> None:
        if truncation not in TRUNCATION_MODES:
            raise DatasetError(f"data.truncation must be one of {list(TRUNCATION_MODES)}, got {truncation!r}")
        if max_prompt_length <= 0:
            raise DatasetError(f"data.max_prompt_length must be positive, got {max_prompt_length}")
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.filter_overlong_prompts = filter_overlong_prompts
        self.render_workers = render_workers  # processes rendering the chat template (`prompt_token_ids`)
        self.media_keys = tuple(media_keys)  # verl's multimodal columns: a row with a value in one is refused
        self.prompt_key = prompt_key
        self.data_source_key = data_source_key
        self.carried_columns = tuple(carried_columns)  # other columns a batch carries (a teacher's routing field)
        # Multi-turn: the tools' OpenAI schemas, which the template renders into the prompt (as the agent loop's
        # renderer does, so the two agree).
        self.chat_template_kwargs = dict(chat_template_kwargs) | ({"tools": tools} if tools else {})
        self.pad_token_id = pad_id(tokenizer)
        self.rows: list[dict[str, Any]] = []
        self.prompt_ids: list[list[int]] = []  # after truncation, unpadded
        self.num_filtered = 0
        self.files = [str(path) for path in ([files] if isinstance(files, (str, Path)) else files)]  # for errors
        for path in self.files:
            self._add_file(Path(path), tokenizer)
        if self.num_filtered:
            logger.info("filtered %d prompts longer than data.max_prompt_length=%d; %d remain",
                        self.num_filtered, max_prompt_length, len(self.rows))
        if max_samples >= 0:  # data.train/val_max_samples: the first rows that passed the length filter
            del self.rows[max_samples:], self.prompt_ids[max_samples:]
        if not self.rows:
            raise DatasetError(
                f"data.filter_overlong_prompts: no prompts left after filtering prompts longer than "
                f"data.max_prompt_length={max_prompt_length}"
            )

    def _add_file(self, path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        # Besides the prompt, every row needs the column that picks its scorer and the answer in reward_model.
        rows = read_rows(path, [self.prompt_key, self.data_source_key, "reward_model"])
        for number, row in enumerate(rows):
            messages = row[self.prompt_key]
            if not isinstance(messages, list):
                raise DatasetError(f"{path} row {number}: {self.prompt_key!r} must be a list of chat messages, got "
                                   f"{type(messages).__name__} (data.prompt_key={self.prompt_key})")
            media = next((key for key in self.media_keys if row.get(key)), None)
            if media is not None:
                raise DatasetError(f"{path} row {number}: has {media!r} (data.image_key / video_key / audio_key); "
                                   f"shardrl trains text models, so multimodal prompts are not supported")
            bad = next((m for m in messages if not isinstance(m, dict) or not isinstance(m.get("role"), str)), None)
            if bad is not None or not messages:
                raise DatasetError(f"{path} row {number}: {self.prompt_key!r} must be a non-empty list of messages "
                                   f"with a 'role' and 'content' each, got {str(bad if messages else messages)[:80]}")
        try:
            ids = prompt_token_ids(tokenizer, [row[self.prompt_key] for row in rows], self.chat_template_kwargs,
                                   self.render_workers)
        except Exception as err:  # the tokenizer's chat template (user-supplied jinja) failed on some row
            raise DatasetError(f"{path}: the tokenizer's chat template failed on its prompts ({type(err).__name__}: "
                               f"{first_line(err)}); check the messages and the template (data.tokenizer)") from None
        for number, (row, row_ids) in enumerate(zip(rows, ids)):
            if len(row_ids) > self.max_prompt_length:
                if self.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                row_ids = self._truncate(row_ids, f"{path} row {number}")
            self.rows.append(row)
            self.prompt_ids.append(row_ids)

    def _truncate(self, ids: list[int], where: str) -> list[int]:
        limit = self.max_prompt_length
        if self.truncation == "left":  # keep the end: the assistant header that generation continues from
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        raise DatasetError(
            f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={limit}; set data.truncation to left or "
            f"right, or data.filter_overlong_prompts=true"
        )

    def __len__(self) -> int:
        return len(self.rows)

    def collate(self, indices: Sequence[int]) -> Batch:
        """Rows `indices` as a Batch.

        tensors: input_ids, attention_mask, position_ids `[B, max_prompt_length]`, left-padded.
        non_tensors: raw_prompt (messages), raw_prompt_ids (unpadded ids), data_source (None where a row has none),
        ability, reward_model, extra_info, the `data_source_key` column when it is another, and `carried_columns`.
        """
        padded = [left_pad(self.prompt_ids[i], self.max_prompt_length, self.pad_token_id) for i in indices]
        input_ids, attention_mask, position_ids = (torch.stack(column) for column in zip(*padded))
        rows = [self.rows[i] for i in indices]
        non_tensors = {
            "raw_prompt": [row[self.prompt_key] for row in rows],
            "raw_prompt_ids": [self.prompt_ids[i] for i in indices],
            "data_source": [row.get("data_source") for row in rows],
            "ability": [row.get("ability") for row in rows],
            "reward_model": [row["reward_model"] for row in rows],
            "extra_info": [row.get("extra_info") or {} for row in rows],
        }
        non_tensors[self.data_source_key] = [row[self.data_source_key] for row in rows]  # data_source by default
        for column in self.carried_columns:
            non_tensors[column] = [row.get(column) for row in rows]
        if any("agent_name" in row for row in rows):
            non_tensors["agent_name"] = [row.get("agent_name") for row in rows]
        tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return Batch(tensors, non_tensors)


class PromptLoader:
    """Batches of `batch_size` prompts, shuffled per epoch from `seed`, resumable mid-epoch.

    The order of epoch e depends only on (seed, e), so a run restored from `state_dict()` yields exactly the batches
    the original run would have yielded next. Iterating yields the rest of the current epoch and then moves the
    position to the start of the next epoch.
    """

    def __init__(
        self, dataset: RLDataset, batch_size: int, shuffle: bool = True, seed: int = 1, drop_last: bool = True
    ) -> None:
        if not 0 < batch_size <= len(dataset):
            raise ValueError(
                f"data.train_batch_size={batch_size} must be in [1, {len(dataset)}] (prompts in the dataset)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0  # prompts of the current epoch already yielded

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        # Seeding with the pair keeps epochs of different seeds apart (seed + epoch would collide).
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def _epoch_end(self) -> int:
        """Prompts yielded per epoch (the dropped tail excluded)."""
        return len(self) * self.batch_size if self.drop_last else len(self.dataset)

    def __iter__(self) -> Iterator[Batch]:
        order = self._order(self.epoch)
        end = self._epoch_end()
        start = self.index
        while start < end:
            indices = order[start:start + self.batch_size].tolist()
            start += len(indices)
            # Advance the position before yielding, so a state saved after the last batch already points at the
            # next epoch.
            self.epoch, self.index = (self.epoch + 1, 0) if start >= end else (self.epoch, start)
            yield self.dataset.collate(indices)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self._epoch_end():
            raise ValueError(f"loader state {state} does not fit {len(self)} batches of {self.batch_size} per epoch")
        self.epoch, self.index = epoch, index
