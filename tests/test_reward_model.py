"""Reward-model scores over shardrl's parallel model equal HF `*ForSequenceClassification` logits (1 process, TP2,
TP2+SP, PP2, PP2xVPP2 on gloo; fixed and dynamic micro batches); the worker puts them on each row's last response
token; a reward model with its own tokenizer scores the sample as its chat template renders it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.testing import assert_close
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig,
                          LlamaForSequenceClassification, PreTrainedTokenizerFast, Qwen2Config,
                          PreTrainedTokenizerBase, Qwen2ForSequenceClassification)

from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data.batch import Batch
from shardrl.data.chat import left_pad, prompt_token_ids
from shardrl.job.options import EngineOptions, ForwardBatching, ModelOptions, OffloadOptions, RewardModelOptions
from shardrl.models.hf_bridge import CheckpointError
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import GroupRegistry
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.workers.reward_model import RewardModelWorker, rerender_for_reward_model, score_sequences
from shardrl.workers.role_model import build_engine

VOCAB, PAD = 300, 0
PROMPT, RESPONSE = 7, 6
PROMPT_LENS = [3, 7, 1, 5, 6, 2]
RESPONSE_LENS = [6, 2, 4, 1, 5, 6]
QWEN3 = "/work/shared/data/tokenizers/qwen3"
BATCHINGS = [ForwardBatching(1, None), ForwardBatching(4, None), ForwardBatching(None, 24)]


def make_rm_checkpoint(kind: str, out_dir: Path) -> str:
    """A random tiny reward model saved by transformers, every parameter perturbed off HF's init."""
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, num_labels=1, pad_token_id=PAD, max_position_embeddings=128)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForSequenceClassification),
                             "qwen2": (Qwen2Config, Qwen2ForSequenceClassification)}[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**sizes)).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(autouse=True)
def collective_timeout(monkeypatch):
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "120")  # as the Ray rank host sets it for the layouts workers build


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rm")
    return {kind: make_rm_checkpoint(kind, root / kind) for kind in ("llama", "qwen2")}


def make_batch() -> Batch:
    """verl's layout: left-padded prompts, right-padded responses (no pad id inside either), response masks with
    holes (row 0 in the middle, row 4 at its end: a masked tail)."""
    g = torch.Generator().manual_seed(1)
    prompts, responses = torch.full((6, PROMPT), PAD), torch.full((6, RESPONSE), PAD)
    attention = torch.zeros(6, PROMPT + RESPONSE, dtype=torch.long)
    for row, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        prompts[row, PROMPT - p:] = torch.randint(1, VOCAB, (p,), generator=g)
        responses[row, :r] = torch.randint(1, VOCAB, (r,), generator=g)
        attention[row, PROMPT - p:PROMPT + r] = 1
    response_mask = attention[:, PROMPT:].float()
    response_mask[0, 2:4] = 0
    response_mask[4, 3:] = 0
    return Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp_min(0),
                  "response_mask": response_mask})


@torch.no_grad()
def hf_scores(path: str, sequences: list[list[int]], pad: int) -> torch.Tensor:
    """HF's scores of `sequences`, right-padded with `pad` (the config's pad_token_id: HF reads the last non-pad)."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, sequences))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def real_tokens(batch: Batch) -> list[list[int]]:
    t = batch.tensors
    return [row[m.bool()].tolist() for row, m in zip(t["input_ids"], t["attention_mask"])]


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, torch.Tensor]:
    sequences = real_tokens(make_batch())
    refs = {kind: hf_scores(path, sequences, PAD) for kind, path in checkpoints.items()}
    # The test can tell the last token from its neighbour and from the critic's predicting positions.
    shifted = hf_scores(checkpoints["llama"], [s[:-1] for s in sequences], PAD)
    assert (refs["llama"] - shifted).abs().min() > 1e-3
    return refs


def rm_options(spec: LayoutSpec, batching: ForwardBatching, sequence_parallel: bool = False, offload: bool = False,
               input_tokenizer: str | None = None, max_length: int | None = None) -> RewardModelOptions:
    model = ModelOptions(spec, list(range(spec.world_size)), EngineOptions(sequence_parallel=sequence_parallel,
                                                                            value_head=True),
                         OffloadOptions(params=offload), {}, load_weight=True, dist_checkpoint=None)
    return RewardModelOptions(model, batching, input_tokenizer, max_length)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_one_process_scores_equal_transformers(checkpoints, references, kind):
    engine = build_engine(rm_options(LayoutSpec(1), BATCHINGS[0]).model, checkpoints[kind], None)
    for batching in BATCHINGS:
        assert_close(score_sequences(engine, make_batch(), batching), references[kind], atol=1e-4, rtol=1e-4,
                     msg=lambda m: f"{kind} {batching}: {m}")


LAYOUTS = [  # (name, layout sizes, sequence parallel, batchings): interleaved PP needs a multiple of PP micro batches
    ("tp2", dict(tp=2), False, BATCHINGS),
    ("tp2+sp", dict(tp=2), True, BATCHINGS),
    ("pp2", dict(pp=2), False, BATCHINGS),
    ("pp2xvpp2", dict(pp=2, vpp=2), False, [ForwardBatching(3, None)]),
]


def scores_on_layouts(checkpoints: dict[str, str]) -> dict[str, torch.Tensor]:
    os.environ[COLLECTIVE_TIMEOUT_ENV] = "120"
    registry, out = GroupRegistry(), {}
    for name, sizes, sp, batchings in LAYOUTS:
        for kind, path in checkpoints.items():
            options = rm_options(LayoutSpec(2, **sizes), batchings[0], sequence_parallel=sp)
            engine = build_engine(options.model, path, registry)
            for batching in batchings:
                out[f"{name}:{kind}:{batching}"] = score_sequences(engine, make_batch(), batching)
    return out


def test_tp2_pp2_scores_equal_transformers_on_every_rank(checkpoints, references):
    results = run_distributed(2, scores_on_layouts, checkpoints)
    assert len(results[0]) == sum(len(b) for *_, b in LAYOUTS) * len(checkpoints)
    for rank_scores in results:  # the last stage's scores reach every rank
        for tag, scores in rank_scores.items():
            assert_close(scores, references[tag.split(":")[1]], atol=1e-4, rtol=1e-4, msg=lambda m: f"{tag}: {m}")


def test_worker_puts_each_score_on_the_last_response_token(checkpoints, references):
    batch = make_batch()
    worker = RewardModelWorker(rm_options(LayoutSpec(1), ForwardBatching(4, None), offload=True), checkpoints["qwen2"])
    rm_scores = worker.compute_rm_score(batch).tensors["rm_scores"]  # [B, R]
    last = [5, 1, 3, 0, 2, 5]  # row 0's holes do not move it; row 4's masked tail does
    expected = torch.zeros(6, RESPONSE)
    expected[torch.arange(6), last] = references["qwen2"]
    assert_close(rm_scores, expected, atol=1e-4, rtol=1e-4)
    assert all(p.untyped_storage().nbytes() == 0 for chunk in worker.rm.chunks for p in chunk.parameters())


def test_a_causal_lm_checkpoint_is_refused(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path / "lm")
    with pytest.raises(CheckpointError, match=f"{path}: no 'score.weight'"):
        RewardModelWorker(rm_options(LayoutSpec(1), ForwardBatching(4, None)), str(path))


def test_an_lm_head_engine_is_refused(checkpoints):
    options = rm_options(LayoutSpec(1), ForwardBatching(4, None))
    lm_engine = dataclasses.replace(options.model, engine=EngineOptions(value_head=False))
    with pytest.raises(ValueError, match="needs value_head=True and optim=None"):
        RewardModelWorker(dataclasses.replace(options, model=lm_engine), checkpoints["llama"])


# ---- a reward model with its own tokenizer --------------------------------------------------------------------------

RM_SPECIAL = ["<pad>", "<|user|>", "<|system|>", "<|assistant|>", "<|end|>"]
RM_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
CHATS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}], "It is 5."),
    ([{"role": "user", "content": "Say hello in French."}], "Bonjour ! Ça va ?"),
    ([{"role": "user", "content": "Count to three."}], "1, 2, 3"),
]


def make_rm_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Byte-level with no merges (any text round-trips), its own specials and chat template: nothing like Qwen3's."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(RM_SPECIAL + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                        additional_special_tokens=RM_SPECIAL[1:])
    tokenizer.chat_template = RM_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def policy_batch(policy: PreTrainedTokenizerBase) -> Batch:
    """Qwen3-rendered prompts (left-padded) and responses ending in <|im_end|> (right-padded), as rollout makes."""
    prompt_ids = prompt_token_ids(policy, [messages for messages, _ in CHATS])
    width = max(map(len, prompt_ids))
    prompts = [left_pad(ids, width, policy.pad_token_id) for ids in prompt_ids]
    response_ids = [policy(text, add_special_tokens=False)["input_ids"] + [policy.convert_tokens_to_ids("<|im_end|>")]
                    for _, text in CHATS]
    length = max(map(len, response_ids)) + 2
    responses = torch.full((len(CHATS), length), policy.pad_token_id)
    response_attention = torch.zeros(len(CHATS), length, dtype=torch.long)
    for row, ids in enumerate(response_ids):
        responses[row, :len(ids)], response_attention[row, :len(ids)] = torch.tensor(ids), 1
    attention = torch.cat([torch.stack([p[1] for p in prompts]), response_attention], 1)
    return Batch({"prompts": torch.stack([p[0] for p in prompts]), "responses": responses,
                  "input_ids": torch.cat([torch.stack([p[0] for p in prompts]), responses], 1),
                  "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp_min(0),
                  "response_mask": response_attention.float()},
                 {"raw_prompt": [messages for messages, _ in CHATS]})


def rm_texts(rm: PreTrainedTokenizerBase) -> list[str]:
    return [rm.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
            for messages, response in CHATS]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return AutoTokenizer.from_pretrained(QWEN3), make_rm_tokenizer(tmp_path_factory.mktemp("rm_tok"))


def test_rerender_writes_the_reward_models_own_template(tokenizers):
    policy, rm = tokenizers
    rendered = rerender_for_reward_model(policy_batch(policy), policy, rm, max_length=128)
    t = rendered.tensors
    assert set(t.keys()) == {"input_ids", "attention_mask", "position_ids"}
    for row, (ids, mask, text) in enumerate(zip(t["input_ids"], t["attention_mask"], rm_texts(rm))):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # right padding: the row's last token is its last real one
        assert rm.decode(ids[:n]) == text
        assert ids[:n].tolist() == rm(text, add_special_tokens=False)["input_ids"]
        assert t["position_ids"][row, :n].tolist() == list(range(n))
    assert "<|im_end|>" not in rm.decode(t["input_ids"][0]) and rm_texts(rm)[0].endswith("It is 5.<|end|>")


def test_rerender_refuses_a_sample_over_max_length(tokenizers):
    policy, rm = tokenizers
    longest = max(len(rm(text, add_special_tokens=False)["input_ids"]) for text in rm_texts(rm))
    rerender_for_reward_model(policy_batch(policy), policy, rm, max_length=longest)
    with pytest.raises(ValueError, match=f"reward_model.max_length={longest - 1}: row 1 re-renders to {longest} "):
        rerender_for_reward_model(policy_batch(policy), policy, rm, max_length=longest - 1)


def test_worker_scores_the_rerendered_sample(tokenizers, tmp_path):
    policy, rm = tokenizers
    path = make_rm_checkpoint("llama", tmp_path / "rm")
    rm.save_pretrained(path)
    options = rm_options(LayoutSpec(1), ForwardBatching(2, None), input_tokenizer=QWEN3, max_length=128)
    batch = policy_batch(policy)
    rm_scores = RewardModelWorker(options, path).compute_rm_score(batch).tensors["rm_scores"]
    expected_scores = hf_scores(path, [rm(text, add_special_tokens=False)["input_ids"] for text in rm_texts(rm)],
                                PAD)
    expected = torch.zeros_like(rm_scores)
    expected[torch.arange(len(CHATS)), batch.tensors["response_mask"].sum(-1).long() - 1] = expected_scores
    assert_close(rm_scores, expected, atol=1e-4, rtol=1e-4)


def test_a_critic_starts_from_a_reward_models_weights(checkpoints):
    """critic.model.path at a reward model: the critic's value head is the reward model's score head (its values
    at each sample's last token are the reward model's scores)."""
    # CriticWorker's engine: score.weight optional (a causal LM has none), loaded when present.
    engine = build_engine(rm_options(LayoutSpec(1), BATCHINGS[0]).model, checkpoints["qwen2"], None,
                          optional_weights=("score.weight",))
    hf = AutoModelForSequenceClassification.from_pretrained(checkpoints["qwen2"], dtype=torch.float32)
    assert torch.equal(engine.chunks[-1].score.weight.detach().cpu(), hf.score.weight.detach())
