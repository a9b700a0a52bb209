"""A generative judge (`reward_model.judge`): an LLM served by a native engine of its own (its own model and
layout, on the trainer pool) reads each sample through a prompt template and writes a verdict, from which a score
parser takes the score.

`judge_prompts` renders the judge's chat prompts, `parse_score` reads a verdict, and `JudgeWorker` runs them
around its engine. The worker returns what it saw: the score (or NaN where the verdict did not parse) and the
verdict text, so the controller applies `on_parse_failure` and names the sample in its error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.data.batch import Batch, as_object_array
from shardrl.job.options import JudgeOptions
from shardrl.parallel.layout import GroupRegistry
from shardrl.rollout.engine import Engine
from shardrl.workers.role_model import create_layout

def question_of(messages: Sequence[dict]) -> str:
    """The question a sample answers: its last user message's content."""
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def judge_prompts(batch: Batch, policy_tokenizer: PreTrainedTokenizerBase, judge_tokenizer: PreTrainedTokenizerBase,
                  template: str) -> list[list[int]]:
    """One judge prompt per row: the template (fields: `options.JUDGE_TEMPLATE_FIELDS`) filled with the row's
    question, its response (the policy's attention-masked tokens decoded, special tokens dropped, as the reward
    function sees them) and its ground truth, as the single user turn of the judge's own chat template."""
    t = batch.tensors
    responses = t["responses"]
    attention = t["attention_mask"][:, -responses.shape[1]:].bool()
    prompts = []
    for row, messages in enumerate(batch.non_tensors["raw_prompt"]):
        fields = {"prompt": question_of(messages),
                  "response": policy_tokenizer.decode(responses[row][attention[row]], skip_special_tokens=True),
                  "ground_truth": str((batch.non_tensors["reward_model"][row] or {}).get("ground_truth", ""))}
        text = judge_tokenizer.apply_chat_template([{"role": "user", "content": template.format_map(fields)}],
                                                   tokenize=False, add_generation_prompt=True)
        prompts.append(judge_tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def parse_score(verdict: str, pattern: re.Pattern[str]) -> float:
    """The score in `verdict`: the last match of `pattern` (its first group, or the whole match without groups) as
    a float; NaN when nothing matches or the match is not a finite number."""
    matches = list(pattern.finditer(verdict))
    if not matches:
        return math.nan
    last = matches[-1]
    try:
        value = float(last.group(1) if pattern.groups else last.group(0))
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


class JudgeWorker:
    def __init__(self, options: JudgeOptions, policy_tokenizer: str, registry: GroupRegistry | None = None) -> None:
        self.options = options
        layout = create_layout(options.spec, options.ranks, registry)
        self.engine = Engine.from_pretrained(options.model_path, layout, options.engine)
        self.tokenizer = AutoTokenizer.from_pretrained(options.model_path)
        self.policy_tokenizer = AutoTokenizer.from_pretrained(policy_tokenizer)
        self.pattern = re.compile(options.score_pattern)
        if options.free_cache_engine:
            self.engine.sleep()

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def judge(self, batch: Batch) -> Batch:
        """`judge_scores` [B] (NaN where the verdict did not parse) and the non-tensor `judge_verdicts` (the judge's
        text). Greedy or seeded by each row's `sample_seed`, so a verdict depends only on the sample."""
        o = self.options
        prompts = judge_prompts(batch, self.policy_tokenizer, self.tokenizer, o.prompt_template)
        longest = max(range(len(prompts)), key=lambda row: len(prompts[row]))
        if len(prompts[longest]) + o.sampling.max_tokens > o.engine.max_model_len:
            raise ValueError(f"reward_model.judge.max_model_len={o.engine.max_model_len}: row {longest}'s judge prompt "
                             f"is {len(prompts[longest])} tokens, plus response_length={o.sampling.max_tokens}; "
                             f"raise max_model_len or shorten the template")
        params = o.sampling.params(batch.tensors["sample_seed"])
        self.engine.wake_up()  # a no-op unless the cache sleeps between calls
        outputs = self.engine.generate(prompts, params)
        if o.free_cache_engine:
            self.engine.sleep()
        verdicts = [self.tokenizer.decode(out.token_ids, skip_special_tokens=True) for out in outputs]
        scores = torch.tensor([parse_score(v, self.pattern) for v in verdicts], dtype=torch.float32)
        return Batch({"judge_scores": scores}, {"judge_verdicts": as_object_array(verdicts)})
