"""Every family, one process: logits and logprobs equal HF transformers' on packed multi-sequence input."""

import json

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close

from shardrl.models.attention import AttentionKernelError, resolve_attention_kernel
from shardrl.models.config import FAMILY_PREFIX, ModelConfig, ModelConfigError, RopeConfig
from shardrl.models.fast_paths import FastPaths
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import TINY_CONFIGS, hf_logits, make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import get_spec

FAMILIES = list(TINY_CONFIGS)
LENGTHS = [5, 9, 3]  # three sequences of different lengths packed into one micro batch


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_checkpoint(family, root / family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_and_logprobs_match_transformers(checkpoints, family):
    ckpt = checkpoints[family]
    input_ids, position_ids, cu_seqlens = packed_batch(LENGTHS, vocab_size=128)
    expected = hf_logits(ckpt, input_ids, cu_seqlens)  # each sequence run alone: proves the block-diagonal mask
    model = Transformer(ModelConfig.from_pretrained(ckpt), Layout.single())
    load_hf_weights(model, ckpt)
    with torch.no_grad():
        hidden = model(input_ids, position_ids, cu_seqlens)
        assert_close(model.compute_logits(hidden, input_ids.shape[0]), expected, atol=1e-4, rtol=1e-4)
        targets = input_ids.roll(-1)
        logprobs, entropy = model.compute_logprobs(hidden, targets, temperature=0.7)
    ref = torch.log_softmax(expected / 0.7, dim=-1)
    assert_close(logprobs, ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-4, rtol=1e-4)
    assert_close(entropy, -(ref.exp() * ref).sum(-1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe"])
def test_recompute_gives_the_same_gradients(checkpoints, family):
    ckpt = checkpoints[family]
    input_ids, position_ids, cu_seqlens = packed_batch(LENGTHS, vocab_size=128)
    grads = []
    for recompute in (False, True):
        model = Transformer(ModelConfig.from_pretrained(ckpt), Layout.single(), recompute=recompute)
        load_hf_weights(model, ckpt)
        logprobs, _ = model.compute_logprobs(model(input_ids, position_ids, cu_seqlens), input_ids.roll(-1))
        logprobs.sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        assert_close(recomputed, plain, atol=1e-6, rtol=1e-5)


def test_config_fields_from_hf_defaults(checkpoints):
    llama = ModelConfig.from_pretrained(checkpoints["llama"])
    assert (llama.rope.kind, llama.rope.factor, llama.tie_word_embeddings) == ("llama3", 8.0, True)
    assert llama.qkv_bias and llama.o_bias
    qwen2_moe = ModelConfig.from_pretrained(checkpoints["qwen2_moe"])
    assert qwen2_moe.moe.layers == frozenset({0}) and qwen2_moe.moe.shared_expert_size == 32
    assert qwen2_moe.moe.norm_topk_prob is False and qwen2_moe.qkv_bias and not qwen2_moe.o_bias
    mixtral = ModelConfig.from_pretrained(checkpoints["mixtral"])
    assert mixtral.moe.expert_proj == ("w1", "w3", "w2") and mixtral.moe.norm_topk_prob
    assert ModelConfig.from_pretrained(checkpoints["qwen3"]).head_dim == 16


_MINIMAL_MOE = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, decoder_sparse_step=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[0]),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_of_a_minimal_config_agree_with_transformers(tmp_path, family):
    """Only sizes given: the parsed config and the parameters built from it match what transformers saves."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(architectures=[f"{FAMILY_PREFIX[family]}ForCausalLM"], vocab_size=64, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               **_MINIMAL_MOE.get(family, {}))
    ours = ModelConfig.from_dict(raw)
    hf_config = AutoConfig.for_model(family, **raw)
    assert ours.rms_norm_eps == hf_config.rms_norm_eps
    assert ours.rope == RopeConfig(hf_config.rope_parameters["rope_theta"])
    assert ours.tie_word_embeddings == hf_config.tie_word_embeddings
    if ours.moe is not None:
        assert ours.moe.norm_topk_prob == getattr(hf_config, "norm_topk_prob", True)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        hf_names = set(saved.keys())
    model = Transformer(ours, Layout.single())
    assert {n for p in model.parameters() for n in get_spec(p).hf_names()} == hf_names


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, r"architectures=\['GPT2LMHeadModel'\] is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
    ({"sliding_window": 4}, "sliding_window=4"),
    ({"hidden_size": None}, "no 'hidden_size'"),
])
def test_unsupported_configs_fail_with_one_line(checkpoints, change, message):
    raw = json.loads((checkpoints["mixtral"] / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=message) as info:
        ModelConfig.from_dict({**raw, **change})
    assert "\n" not in str(info.value)


def test_attention_kernel_resolution_on_a_machine_without_fa4(checkpoints):
    """`auto` falls back to torch's flash where FA4 cannot run; an explicit `fa4` there fails building the model with
    one line saying why (the launch check refuses it before workers start; this is the worker's own guard)."""
    cpu = torch.device("cpu")
    assert resolve_attention_kernel("auto", cpu, 64) == "flash"
    assert resolve_attention_kernel("flash", cpu, 64) == "flash"
    config = ModelConfig.from_pretrained(checkpoints["qwen2"])
    with pytest.raises(AttentionKernelError, match=r"^attention_backend=fa4: FlashAttention-4 runs on CUDA GPUs only; "
                                                   r"set flash or auto$"):
        Transformer(config, Layout.single("cpu"), fast=FastPaths(attention="fa4"))
