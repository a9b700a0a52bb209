"""`model.override_config`: overrides of config.json fields change the ModelConfig and the model built from it;
a field the family's config does not have is refused by name. The accepted fields are transformers' own."""

import json
import shutil

import pytest
import torch
from torch.testing import assert_close

from shardrl.models.config import (_COMMON_FIELDS, _FIELDS, FAMILY_PREFIX, ModelConfig, OverrideError,
                                   apply_overrides)
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import TINY_CONFIGS, hf_logits, make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import Transformer
from shardrl.parallel.layout import Layout

# Names shardrl reads that transformers 5's config classes no longer list (older config.json files carry them).
LEGACY = {"rope_theta", "rope_scaling", "torch_dtype", "head_dim", "num_experts", "num_local_experts"}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("hf") / "qwen3")


def test_no_overrides_read_config_json_as_it_is(qwen3):
    assert ModelConfig.from_pretrained(qwen3, {}) == ModelConfig.from_pretrained(qwen3)
    raw = json.loads((qwen3 / "config.json").read_text())
    assert apply_overrides(raw, {}) == raw


def test_overrides_change_the_config_and_the_model(qwen3):
    base = ModelConfig.from_pretrained(qwen3)
    assert (base.num_layers, base.rms_norm_eps, base.rope.theta) == (2, 1e-6, 10000.0)
    changed = ModelConfig.from_pretrained(qwen3, {"num_hidden_layers": 1, "rms_norm_eps": 1e-2, "rope_theta": 1e6})
    assert (changed.num_layers, changed.rms_norm_eps, changed.rope.theta) == (1, 1e-2, 1e6)
    # config.json of this checkpoint keeps RoPE in rope_parameters (transformers 5): rope_theta must reach it.
    assert changed.hf_config["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
    assert changed.hf_config["num_hidden_layers"] == 1  # what an export writes
    assert len(Transformer(changed, Layout.single()).layers) == 1


def test_the_overridden_model_is_transformers_model_of_the_edited_config(qwen3, tmp_path):
    """Same weights, eps and theta overridden: transformers' logits for a config.json edited by hand, not the
    original ones."""
    overrides = {"rms_norm_eps": 1e-2, "rope_theta": 1e6}
    edited = tmp_path / "edited"
    shutil.copytree(qwen3, edited)
    raw = json.loads((edited / "config.json").read_text())
    raw |= {"rms_norm_eps": 1e-2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    (edited / "config.json").write_text(json.dumps(raw))
    input_ids, position_ids, cu_seqlens = packed_batch([5, 7], vocab_size=128)
    model = Transformer(ModelConfig.from_pretrained(qwen3, overrides), Layout.single())
    load_hf_weights(model, qwen3)
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, position_ids, cu_seqlens), input_ids.shape[0])
    assert_close(logits, hf_logits(edited, input_ids, cu_seqlens), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits, hf_logits(qwen3, input_ids, cu_seqlens), atol=1e-3)


def test_rope_scaling_overrides_replace_the_scaling(tmp_path):
    llama = make_tiny_checkpoint("llama", tmp_path / "llama")  # llama3 scaling, in rope_parameters
    assert ModelConfig.from_pretrained(llama).rope.kind == "llama3"
    linear = ModelConfig.from_pretrained(llama, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}).rope
    assert (linear.kind, linear.factor, linear.theta) == ("linear", 2.0, 10000.0)
    assert ModelConfig.from_pretrained(llama, {"rope_scaling": None}).rope.kind == "default"
    # A config.json with the legacy keys: they are overridden in place.
    raw = {k: v for k, v in json.loads((llama / "config.json").read_text()).items() if k != "rope_parameters"}
    raw |= {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    rope = ModelConfig.from_dict(apply_overrides(raw, {"rope_theta": 1e6, "rope_scaling": None})).rope
    assert (rope.kind, rope.theta) == ("default", 1e6)


def test_unknown_fields_are_refused_by_name(qwen3):
    with pytest.raises(OverrideError, match=r"^model.override_config.num_hiden_layers: not a field of the Qwen3 "
                                            r"config; did you mean 'num_hidden_layers'\?$") as error:
        ModelConfig.from_pretrained(qwen3, {"num_hiden_layers": 1})
    assert error.value.field == "num_hiden_layers"
    with pytest.raises(OverrideError, match="model.override_config.moe_intermediate_size: not a field of the Qwen3"):
        ModelConfig.from_pretrained(qwen3, {"moe_intermediate_size": 16})  # a Qwen3-MoE field


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_accepted_fields_are_the_transformers_config_fields(family):
    """Every field of transformers' config class of the family is accepted, and nothing else but legacy names."""
    from transformers import AutoConfig

    theirs = set(AutoConfig.for_model(family).to_dict())
    ours = _COMMON_FIELDS | _FIELDS[family]
    assert theirs <= ours, f"{FAMILY_PREFIX[family]}: not accepted: {sorted(theirs - ours)}"
    extra = ours - theirs - LEGACY
    assert not extra, f"{FAMILY_PREFIX[family]}: not transformers' fields: {sorted(extra)}"
