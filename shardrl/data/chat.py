"""Chat-template helpers shared by the dataset and the rollout side."""

from __future__ import annotations

import multiprocessing
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

# Arguments of `apply_chat_template` that `prompt_token_ids` sets itself: the prompt must end with the assistant
# header, and it is rendered to text first (see there).
_RENDER_ARGS = ("add_generation_prompt", "tokenize", "conversation")


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict[str, Any]]],
                     template_kwargs: Mapping[str, Any] = {}, workers: int = 1) -> list[list[int]]:
    """Token ids of each conversation rendered with the tokenizer's chat template, ending with the assistant header.

    The template is rendered to text and then tokenized without extra special tokens: the template already writes
    every special token it wants, and a BOS added on top would make the prompt differ from what the model saw.
    Tokenizing all texts in one call lets the fast tokenizer work on them in parallel. `template_kwargs` (verl's
    `data.apply_chat_template_kwargs`, e.g. Qwen3's ``enable_thinking=False``) go to `apply_chat_template`, which
    passes those it does not take itself on to the template. The template is Python (jinja) and runs one conversation
    at a time: `workers` > 1 renders contiguous shares of the conversations in that many processes of their own
    (verl's `data.filter_overlong_prompts_workers`), which pays off for large datasets (each process starts by
    importing transformers, a few seconds).
    """
    reserved = sorted(set(template_kwargs) & set(_RENDER_ARGS))
    if reserved:
        raise ValueError(f"data.apply_chat_template_kwargs.{reserved[0]}: set by shardrl when rendering prompts "
                         f"(the prompt ends with the assistant header, rendered to text); drop it")
    if workers > 1 and len(conversations) > 1:
        share = -(-len(conversations) // workers)
        parts = [conversations[i:i + share] for i in range(0, len(conversations), share)]
        context = multiprocessing.get_context("spawn")  # never fork the driver (Ray, torch and tokenizer threads)
        with ProcessPoolExecutor(len(parts), mp_context=context) as pool:
            rendered = pool.map(render_prompts, [tokenizer] * len(parts), parts, [dict(template_kwargs)] * len(parts))
            texts = [text for part in rendered for text in part]
    else:
        texts = render_prompts(tokenizer, conversations, template_kwargs)
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def render_prompts(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict[str, Any]]],
                   template_kwargs: Mapping[str, Any]) -> list[str]:
    """Each conversation rendered to text with the chat template, ending with the assistant header."""
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **template_kwargs)
            for m in conversations]


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id written into padded positions. Tokenizers without a pad token (Llama) use EOS: padded positions are
    masked out everywhere, so only the id's validity matters."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def left_pad(ids: list[int], length: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ids` left-padded to `length`: input_ids, attention_mask and position_ids, each `[length]`.

    Left padding puts every prompt's last token at the same column, where generation continues. Position ids count
    real tokens from 0; padded positions get 0 (they are masked, the value only has to be a valid index).
    """
    if len(ids) > length:
        raise ValueError(f"left_pad: {len(ids)} ids do not fit in length {length}")
    num_pad = length - len(ids)
    input_ids = torch.tensor([pad_token_id] * num_pad + list(ids), dtype=torch.long)  # [L]
    attention_mask = torch.cat([torch.zeros(num_pad, dtype=torch.long), torch.ones(len(ids), dtype=torch.long)])
    position_ids = (attention_mask.cumsum(0) - 1).clamp(min=0)  # [L]
    return input_ids, attention_mask, position_ids
