"""HF bridge in one process: sharded index files, HF checkpoints written by shardrl, the value head, bad inputs."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from shardrl.models.config import ModelConfig, ModelConfigError
from shardrl.models.hf_bridge import CheckpointError, load_hf_weights, save_hf_checkpoint
from shardrl.models.tiny import hf_logits, make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import VALUE_HEAD_NAME, Transformer
from shardrl.parallel.layout import Layout
from shardrl.parallel.spec import get_spec

BATCH = packed_batch([4, 7], vocab_size=128)


def _loaded(path, **kwargs) -> Transformer:
    model = Transformer(ModelConfig.from_pretrained(path), Layout.single(), **kwargs)
    load_hf_weights(model, path, optional=(VALUE_HEAD_NAME,) if kwargs.get("value_head") else ())
    return model


def _params(model: Transformer) -> dict[str, torch.Tensor]:
    return {get_spec(p).hf_name: p.detach() for p in model.parameters()}


def test_sharded_index_and_sharded_save_round_trip(tmp_path):
    single = make_tiny_checkpoint("qwen2_moe", tmp_path / "single")
    sharded = make_tiny_checkpoint("qwen2_moe", tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    model = _loaded(sharded)
    for name, value in _params(_loaded(single)).items():
        assert torch.equal(_params(model)[name], value), name

    out = tmp_path / "saved"
    save_hf_checkpoint(model, Layout.single(), out, max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not list(out.glob("part-*"))
    original = load_file(single / "model.safetensors")
    assert sorted(index["weight_map"]) == sorted(original)
    expected = hf_logits(single, BATCH[0], BATCH[2])
    assert_close(hf_logits(out, BATCH[0], BATCH[2]), expected, atol=1e-6, rtol=1e-6)


def test_value_head_starts_from_a_causal_lm_and_saves_as_sequence_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification

    ckpt = make_tiny_checkpoint("llama", tmp_path / "lm")
    critic = _loaded(ckpt, value_head=True)
    again = _loaded(ckpt, value_head=True)
    assert torch.equal(critic.score.weight, again.score.weight)  # same init on every rank and run
    assert 0.01 < critic.score.weight.std().item() < 0.04  # N(0, 0.02)
    input_ids, position_ids, cu_seqlens = BATCH
    with torch.no_grad():
        values = critic.compute_values(critic(input_ids, position_ids, cu_seqlens), input_ids.shape[0])

    out = tmp_path / "critic"
    save_hf_checkpoint(critic, Layout.single(), out)
    hf = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(hf.score.weight, critic.score.weight.detach())
    bounds = cu_seqlens.tolist()
    with torch.no_grad():
        expected = torch.cat([hf.score(hf.model(input_ids[a:b][None]).last_hidden_state)[0, :, 0]
                              for a, b in zip(bounds, bounds[1:])])
    assert_close(values, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(_loaded(out, value_head=True).score.weight, critic.score.weight)


def _one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_checkpoints_fail_with_one_line_naming_file_and_key(tmp_path):
    sharded = make_tiny_checkpoint("qwen3", tmp_path / "sharded", max_shard_size="20KB")
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    name, file = next(iter(weight_map.items()))
    (sharded / file).unlink()
    with pytest.raises(CheckpointError) as info:
        _loaded(sharded)
    assert file in _one_line(info) and "missing" in str(info.value)

    single = make_tiny_checkpoint("qwen3", tmp_path / "single")
    tensors = load_file(single / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, single / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.norm.weight' is missing") as info:
        _loaded(single)
    _one_line(info)

    wrong = make_tiny_checkpoint("qwen3", tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight' has shape \(64, 32\) but the model expects "
                                              r"\(48, 32\)") as info:
        _loaded(wrong)
    assert "model.safetensors" in _one_line(info)

    (wrong / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ModelConfigError, match="BertForMaskedLM") as info:
        ModelConfig.from_pretrained(wrong)
    _one_line(info)

    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty: neither model.safetensors nor") as info:
        load_hf_weights(Transformer(ModelConfig.from_pretrained(single), Layout.single()), tmp_path / "empty")
    _one_line(info)

