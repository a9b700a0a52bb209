"""The batch container that moves samples between the controller and workers.

A `Batch` holds three things, mirroring verl's `DataProto` (`batch`, `non_tensor_batch`, `meta_info`):

- `tensors`: `TensorColumns`, a dict of tensors with B rows each (input ids, masks, logprobs, advantages, ...);
- `non_tensors`: per-sample Python objects as numpy object arrays of length B (raw prompts, `data_source`,
  `reward_model`, `uid`, ...);
- `meta`: batch-level values that are not per sample (global token counts, temperature, metrics).

Every operation returns a new `Batch` (rows are indexed, never edited in place), so a batch handed to a worker
cannot be changed under the caller. Meta conventions that operations rely on:

- `meta["metrics"]`: a dict of metric name -> list; `concat` appends the lists instead of requiring equality.
- `meta["num_pad"]`: rows appended by `pad_to_divisor`; `unpad` removes them again.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

METRICS_KEY = "metrics"
NUM_PAD_KEY = "num_pad"


class BatchError(ValueError):
    """A batch operation was asked for something inconsistent (length mismatch, conflicting keys, ...)."""


def as_object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array of `values`; built element-wise so a list of lists does not become a 2-D array."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


class TensorColumns(dict[str, torch.Tensor]):
    """A batch's tensor columns: a dict whose every value has `num_rows` rows (its first dimension), which it
    checks as a column is set. It knows its row count without any column (a batch of only non-tensor columns).

    A plain dict rather than tensordict's TensorDict: the batch needs no more than this, and importing tensordict
    imports torch._dynamo, over a second of start-up in every process (driver, each Ray worker)."""

    def __init__(self, columns: Mapping[str, torch.Tensor], num_rows: int) -> None:
        super().__init__()
        self.num_rows = num_rows
        for key, value in columns.items():
            self[key] = value

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if value.dim() == 0 or value.shape[0] != self.num_rows:
            raise BatchError(f"tensor column {key!r} of shape {tuple(value.shape)}: the batch has {self.num_rows} rows")
        super().__setitem__(key, value)

    def __reduce__(self):  # pickled (Ray, checkpoints) as its class, columns and row count
        return TensorColumns, (dict(self), self.num_rows)

    def rows(self, index: torch.Tensor | slice | Sequence[int]) -> TensorColumns:
        """The columns' rows `index` (a slice: views; indices: copies, in that order)."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        num_rows = len(range(self.num_rows)[index]) if isinstance(index, slice) else len(index)
        return TensorColumns({k: v[index] for k, v in self.items()}, num_rows)


class Batch:
    """Tensors + per-sample non-tensor columns + meta, all with the same number of rows."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Sequence[Any]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        # Columns without keys still know their row count (e.g. a batch of only non-tensor columns).
        lengths = {"tensors": tensors.num_rows} if isinstance(tensors, TensorColumns) and not tensors else {}
        tensors = dict(tensors.items()) if tensors is not None else {}
        non_tensors = {k: as_object_array(v) for k, v in (non_tensors or {}).items()}
        lengths |= {f"tensors[{k!r}]": v.shape[0] for k, v in tensors.items()}
        lengths |= {f"non_tensors[{k!r}]": len(v) for k, v in non_tensors.items()}
        if len(set(lengths.values())) > 1:
            raise BatchError(f"batch columns have different numbers of rows: {lengths}")
        num_rows = next(iter(lengths.values()), 0)
        self.tensors = TensorColumns(tensors, num_rows)
        self.non_tensors = non_tensors
        self.meta = meta if meta is not None else {}

    def __len__(self) -> int:
        return self.tensors.num_rows

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"Batch(len={len(self)}, tensors={shapes}, non_tensors={list(self.non_tensors)}, meta={list(self.meta)})"

    def _with_rows(self, rows: torch.Tensor | slice) -> Batch:
        """A new batch holding `rows` of this one (a slice or an index tensor); meta is deep-copied."""
        np_rows = rows.numpy() if isinstance(rows, torch.Tensor) else rows
        return Batch(
            self.tensors.rows(rows),
            {k: v[np_rows] for k, v in self.non_tensors.items()},
            copy.deepcopy(self.meta),
        )

    def take(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """Rows `indices` in that order (reorder, subset or repeat rows)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        if index.numel() and (index.min() < 0 or index.max() >= len(self)):
            raise BatchError(f"take: indices must lie in [0, {len(self)}), got min {index.min()} max {index.max()}")
        return self._with_rows(index)

    def select(
        self, tensor_keys: Sequence[str] | None = None, non_tensor_keys: Sequence[str] | None = None
    ) -> Batch:
        """Only the named columns (None keeps all of that kind, [] keeps none); meta is kept."""
        for keys, have, kind in ((tensor_keys, self.tensors.keys(), "tensors"),
                                 (non_tensor_keys, self.non_tensors.keys(), "non_tensors")):
            missing = sorted(set(keys or ()) - set(have))
            if missing:
                raise BatchError(f"select: {kind} has no keys {missing}; it has {sorted(have)}")
        tensors = self.tensors if tensor_keys is None else TensorColumns(
            {k: self.tensors[k] for k in tensor_keys}, len(self))
        non_tensors = self.non_tensors if non_tensor_keys is None else {k: self.non_tensors[k] for k in non_tensor_keys}
        return Batch(tensors, non_tensors, copy.deepcopy(self.meta))

    def union(self, other: Batch) -> Batch:
        """All columns and meta of both batches; a key present in both must hold equal values."""
        if len(self) != len(other):
            raise BatchError(f"union: batches have {len(self)} and {len(other)} rows")
        tensors = dict(self.tensors.items())
        for key, value in other.tensors.items():
            if key in tensors and not (tensors[key].shape == value.shape and torch.equal(tensors[key], value)):
                raise BatchError(f"union: tensor {key!r} differs between the two batches")
            tensors[key] = value
        non_tensors = dict(self.non_tensors)
        for key, value in other.non_tensors.items():
            if key in non_tensors and list(non_tensors[key]) != list(value):
                raise BatchError(f"union: non-tensor column {key!r} differs between the two batches")
            non_tensors[key] = value
        meta = dict(self.meta)
        for key, value in other.meta.items():
            if key in meta and meta[key] != value:
                raise BatchError(f"union: meta {key!r} differs: {meta[key]!r} vs {value!r}")
            meta[key] = value
        return Batch(tensors, non_tensors, copy.deepcopy(meta))

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive pieces with the given row counts (they must add up to len(self))."""
        if sum(sizes) != len(self) or any(s < 0 for s in sizes):
            raise BatchError(f"split: sizes {list(sizes)} must be non-negative and sum to {len(self)} rows")
        starts = np.cumsum([0, *sizes])
        return [self._with_rows(slice(int(a), int(b))) for a, b in zip(starts[:-1], starts[1:])]

    def chunk(self, num_chunks: int, pad: bool = False) -> list[Batch]:
        """`num_chunks` equal pieces. Uneven lengths are refused unless `pad`, which pads first (see pad_to_divisor)."""
        if num_chunks <= 0:
            raise BatchError(f"chunk: num_chunks must be positive, got {num_chunks}")
        batch = self
        if len(self) % num_chunks:
            if not pad:
                raise BatchError(f"chunk: {len(self)} rows do not split evenly into {num_chunks} chunks; pass pad=True")
            batch = self.pad_to_divisor(num_chunks)
        return batch.split([len(batch) // num_chunks] * num_chunks)

    def pad_to_divisor(self, divisor: int) -> Batch:
        """Append copies of the first rows until len is a multiple of `divisor`; records meta["num_pad"].

        Copies of real rows (not zeros) keep padded rows valid model inputs (an all-zero attention mask would give
        NaNs); callers drop their outputs with `unpad`.
        """
        if divisor <= 0 or len(self) == 0:
            raise BatchError(
                f"pad_to_divisor: need divisor > 0 and a non-empty batch, got {divisor} and {len(self)} rows"
            )
        num_pad = -len(self) % divisor
        rows = torch.cat([torch.arange(len(self)), torch.arange(num_pad) % len(self)])
        padded = self._with_rows(rows)
        padded.meta[NUM_PAD_KEY] = padded.meta.get(NUM_PAD_KEY, 0) + num_pad
        return padded

    def unpad(self) -> Batch:
        """Drop the rows added by `pad_to_divisor` (meta["num_pad"]) and forget the count."""
        num_pad = self.meta.get(NUM_PAD_KEY, 0)
        out = self._with_rows(slice(0, len(self) - num_pad))
        out.meta.pop(NUM_PAD_KEY, None)
        return out

    def repeat(self, times: int, interleave: bool = True) -> Batch:
        """Each row `times` times: interleaved (a a b b, GRPO's n samples per prompt) or tiled (a b a b)."""
        rows = torch.arange(len(self))
        return self._with_rows(rows.repeat_interleave(times) if interleave else rows.repeat(times))

    def to(self, device: torch.device | str) -> Batch:
        """Tensors moved to `device`; non-tensor values and meta values are shared, not copied."""
        return Batch(TensorColumns({k: v.to(device) for k, v in self.tensors.items()}, len(self)),
                     dict(self.non_tensors), dict(self.meta))

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order. Column keys must match; meta["metrics"] lists are appended, other meta
        keys must be equal in every batch (a conflict raises naming the key)."""
        if not batches:
            raise BatchError("concat: no batches given")
        first = batches[0]
        for b in batches[1:]:
            if set(b.tensors.keys()) != set(first.tensors.keys()) or set(b.non_tensors) != set(first.non_tensors):
                raise BatchError(
                    f"concat: column keys differ: {sorted(first.tensors.keys())} + {sorted(first.non_tensors)} vs "
                    f"{sorted(b.tensors.keys())} + {sorted(b.non_tensors)}"
                )
        tensors = TensorColumns({k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
                                sum(len(b) for b in batches))
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        return Batch(tensors, non_tensors, _merge_meta([b.meta for b in batches]))


def _merge_meta(metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for meta in metas:
        for key, value in meta.items():
            if key == METRICS_KEY:
                metrics = merged.setdefault(METRICS_KEY, {})
                for name, values in value.items():
                    metrics.setdefault(name, []).extend(values)
            elif key in merged and merged[key] != value:
                raise BatchError(f"concat: meta {key!r} differs between batches: {merged[key]!r} vs {value!r}")
            else:
                merged[key] = copy.deepcopy(value)
    return merged
