"""Model-based rewards on one rank: a sequence-classification checkpoint's `score` head read at each sample's last
token (`score_sequences`), the re-rendering for a reward model with its own tokenizer (`rerender_for_reward_model`),
and `RewardModelWorker`, which holds the frozen value-head engine and calls them with its `RewardModelOptions`.

"Last token" is the last position whose `attention_mask` is 1, as verl reads it (`argmax(position_ids *
attention_mask)`) and as HF's `*ForSequenceClassification` does on right-padded input without pad ids inside.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shardrl.controller.dispatch import Dispatch, dispatch_mode
from shardrl.data.batch import Batch
from shardrl.data.chat import pad_id
from shardrl.job.options import ForwardBatching, ModelOptions, RewardModelOptions
from shardrl.models.checkpoint import saved_model_tensors
from shardrl.models.hf_bridge import CheckpointError, HFCheckpointReader
from shardrl.models.transformer import VALUE_HEAD_NAME, Transformer
from shardrl.parallel.layout import GroupRegistry
from shardrl.rewards.manager import place_on_last_token
from shardrl.workers.engine import MicroBatch, ModelEngine, make_micro_batches, stack_outputs
from shardrl.workers.role_model import build_engine, resident
from shardrl.workers.packing import whole_micro_batch

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def _last_token_scores(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> Tensor:
    """The score head at each packed sequence's last token: [b]. Packing keeps a row's valid tokens in order, so
    sequence i ends at packed position cu_seqlens[i + 1] - 1."""
    values = chunk.compute_values(hidden, mb.packed.num_tokens).float()  # [T], gathered over TP with SP
    values = whole_micro_batch(values, mb.packed)  # and over CP
    return values[mb.packed.cu_seqlens[1:].long() - 1]


@torch.no_grad()
def score_sequences(engine: ModelEngine, batch: Batch, batching: ForwardBatching) -> Tensor:
    """The reward model's score of each row's whole sequence (`input_ids`/`attention_mask`/`position_ids`, prompt
    and response alike): [B] fp32 on the host, on every rank of the layout (the last stage computes, PP broadcasts)."""
    def loss_fn(chunk: Transformer, hidden: Tensor, mb: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return hidden.new_zeros(()), {"scores": _last_token_scores(chunk, hidden, mb)}

    t = batch.tensors
    # Packing cuts `responses` off the end of each row for per-token outputs; a score reads none, so width 0.
    sequences = Batch({k: t[k] for k in SEQUENCE_KEYS} | {"responses": t["input_ids"][:, :0]})
    micro_batches, restore = make_micro_batches(sequences, (), engine.layout.device, batching.micro_batch_size,
                                                batching.max_token_len,
                                                count_group=engine.count_group)
    outputs = engine.run(micro_batches, loss_fn, forward_only=True)
    return stack_outputs(outputs, "scores", restore).cpu()


def rerender_for_reward_model(batch: Batch, policy_tokenizer: PreTrainedTokenizerBase,
                              rm_tokenizer: PreTrainedTokenizerBase, max_length: int) -> Batch:
    """Each row as the reward model's own chat template writes it: the response decoded with the policy's tokenizer
    (its attention-masked tokens, special tokens dropped), appended to `raw_prompt` as the assistant turn, rendered
    and tokenized by `rm_tokenizer` alone. Returns `input_ids`/`attention_mask`/`position_ids` right-padded to the
    longest row. A row longer than `max_length` is refused: cutting either end would change what is judged (the
    question, or the end of the answer where the score is read)."""
    t = batch.tensors
    responses, response_attention = t["responses"], t["attention_mask"][:, -t["responses"].shape[1]:]
    texts = []
    for row, messages in enumerate(batch.non_tensors["raw_prompt"]):
        response = policy_tokenizer.decode(responses[row][response_attention[row].bool()], skip_special_tokens=True)
        texts.append(rm_tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}],
                                                      tokenize=False, add_generation_prompt=False))
    rows = rm_tokenizer(texts, add_special_tokens=False)["input_ids"]
    longest = max(range(len(rows)), key=lambda r: len(rows[r]))
    if len(rows[longest]) > max_length:
        raise ValueError(f"reward_model.max_length={max_length}: row {longest} re-renders to {len(rows[longest])} "
                         f"reward-model tokens; raise reward_model.max_length to at least the longest sample")
    width = len(rows[longest])
    input_ids = torch.full((len(rows), width), pad_id(rm_tokenizer), dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)  # [B, L]
    for row, ids in enumerate(rows):
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, :len(ids)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # [B, L]
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids})


def check_reward_model(options: ModelOptions, model_path: str) -> None:
    """Refuse a reward model built without its score head or with an optimizer, or whose weights lack the score
    head (a causal LM, not a sequence classifier)."""
    engine = options.engine
    if not engine.value_head or engine.optim is not None:
        raise ValueError(f"reward model {model_path}: its engine needs value_head=True and optim=None (a frozen score "
                         f"head), got value_head={engine.value_head}, optim={engine.optim}")
    if not options.load_weight:
        raise CheckpointError(f"{model_path}: a reward model is loaded, never randomly initialised; "
                              f"set its load_weight=true")
    path = options.dist_checkpoint or model_path
    names = saved_model_tensors(path) if options.dist_checkpoint else HFCheckpointReader(path)
    if VALUE_HEAD_NAME not in names:
        raise CheckpointError(f"{path}: no {VALUE_HEAD_NAME!r}, so not a reward model; use an HF "
                              f"*ForSequenceClassification checkpoint with num_labels=1")


class RewardModelWorker:
    def __init__(self, options: RewardModelOptions, model_path: str, registry: GroupRegistry | None = None) -> None:
        check_reward_model(options.model, model_path)
        self.options = options
        self.rm = build_engine(options.model, model_path, registry)
        self.tokenizers: tuple[PreTrainedTokenizerBase, PreTrainedTokenizerBase] | None = None
        if options.input_tokenizer is not None:
            self.tokenizers = (AutoTokenizer.from_pretrained(options.input_tokenizer),
                               AutoTokenizer.from_pretrained(model_path))

    def _resident(self):
        return resident(self.rm, self.options.model)

    @dispatch_mode(Dispatch.DP_COMPUTE)
    def compute_rm_score(self, batch: Batch) -> Batch:
        """`rm_scores` [B, R]: each row's score on its last response token (`response_mask`), zero elsewhere."""
        rm_batch = batch
        if self.tokenizers is not None:  # verl's default length: the samples' own width
            max_length = self.options.max_length or batch.tensors["attention_mask"].shape[1]
            rm_batch = rerender_for_reward_model(batch, *self.tokenizers, max_length)
        with self._resident():
            scores = score_sequences(self.rm, rm_batch, self.options.forward)  # [B]
        t = batch.tensors
        failed = t["agent_loop_errors"] if "agent_loop_errors" in t.keys() else None
        return Batch({"rm_scores": place_on_last_token(scores, t["response_mask"], failed)})
