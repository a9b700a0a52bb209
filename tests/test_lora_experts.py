"""LoRA on MoE experts (`parallel.lora.ExpertLoRA`, PEFT's `target_parameters` on transformers' stacked expert
weights) against PEFT on transformers, and through the actor path at EP2 x ETP2 (and, slow, EP2, TP2 x EP2,
PP2 x EP2) against one process.

PEFT is the independent reference for the maths and the format: our exported adapter, loaded by
`PeftModel.from_pretrained` on the transformers model, gives our log-probs, and PEFT's gradients of its stacked
tensors equal ours stacked; gate and up share each expert's A there, as here."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import load_hf_weights, save_hf_checkpoint, save_peft_adapter
from shardrl.models.tiny import hf_logits, make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import Transformer
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.lora import (EXPERT_PARAMETERS, LoRASettings, adapters_disabled, attach_lora, lora_parameters,
                                   peft_expert_keys, stack_expert_adapter)
from shardrl.parallel.spec import get_spec
from tests.test_lora import full_b, local_slice
from tests.test_parity_matrix import check_against_reference, train_on_layout

LENGTHS = [6, 3, 8]
VOCAB = 96
EXPERT_LORA = LoRASettings(rank=4, alpha=8.0, target_modules=("q_proj", "o_proj"), seed=11,
                           target_parameters=EXPERT_PARAMETERS)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_experts")
    # Qwen2-MoE has a shared expert (ordinary linears, named by target_modules); Mixtral names its experts w1/w3/w2
    # on disk but transformers' module path is `mlp.experts` all the same.
    return {family: str(make_tiny_checkpoint(family, root / family, vocab_size=VOCAB))
            for family in ("qwen3_moe", "qwen2_moe", "mixtral")}


def _adapted_model(path: str, settings: LoRASettings) -> Transformer:
    """The 1-process model with adapters whose B are nonzero (`full_b`: training starts from 0, which hides B)."""
    layout = Layout.single("cpu")
    config = ModelConfig.from_pretrained(path)
    model = Transformer(config, layout, range(config.num_layers), True, True)
    load_hf_weights(model, path)
    attach_lora(model, settings, layout)
    with torch.no_grad():
        for param in lora_parameters(model):
            spec = get_spec(param)
            if ".lora_B." in spec.hf_name:
                fulls = [full_b(name, spec.full_shape) for name in spec.hf_names()]
                param.copy_(torch.stack([local_slice(f, param) for f in fulls]) if spec.expert else fulls[0])
    return model


def _log_probs(model, input_ids, position_ids, cu_seqlens, targets) -> torch.Tensor:
    log_probs, _ = model.compute_logprobs(model(input_ids, position_ids, cu_seqlens), targets)
    return log_probs


def _peft_log_probs(peft_model, input_ids, cu_seqlens, targets) -> torch.Tensor:
    bounds = cu_seqlens.tolist()
    logits = torch.cat([peft_model(input_ids[a:b].unsqueeze(0)).logits[0] for a, b in zip(bounds, bounds[1:])])
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("qwen2_moe", marks=pytest.mark.slow),
                                    pytest.param("mixtral", marks=pytest.mark.slow)])
def test_expert_adapters_export_to_peft_and_equal_its_log_probs_and_gradients(moe_checkpoints, family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = moe_checkpoints[family]
    input_ids, position_ids, cu_seqlens = packed_batch(LENGTHS, vocab_size=VOCAB)
    targets = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(4))
    model = _adapted_model(path, EXPERT_LORA)
    ours = _log_probs(model, input_ids, position_ids, cu_seqlens, targets)
    ours.sum().backward()
    save_peft_adapter(model, Layout.single("cpu"), tmp_path / "peft", base_model=path)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == list(EXPERT_PARAMETERS)
    assert config["target_modules"] == ["o_proj", "q_proj"]

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                           tmp_path / "peft", is_trainable=True)
    expected = _peft_log_probs(peft_model, input_ids, cu_seqlens, targets)
    assert_close(ours.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    with torch.no_grad(), adapters_disabled([model]):  # switched off: transformers' base model
        base = _log_probs(model, input_ids, position_ids, cu_seqlens, targets)
    assert_close(base, hf_logits(path, input_ids, cu_seqlens).log_softmax(-1).gather(-1, targets[:, None])[:, 0],
                 atol=1e-5, rtol=1e-5)
    assert not torch.allclose(base, expected, atol=1e-3)  # the expert adapters change the model

    expected.sum().backward()
    peft_grads = {name.replace(".default", ""): p.grad for name, p in peft_model.named_parameters() if ".lora_" in name}
    layers = [layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts")]
    assert layers, family
    for moe in layers:
        for adapter, parameter in ((moe.lora_gate_up, EXPERT_PARAMETERS[0]), (moe.lora_down, EXPERT_PARAMETERS[1])):
            a_key, b_key = peft_expert_keys(moe.layer_id, parameter, EXPERT_PARAMETERS)
            a_grad, b_grad = stack_expert_adapter(adapter.lora_A.grad, [b.grad for b in adapter.lora_B])
            assert_close(a_grad, peft_grads[a_key], atol=1e-5, rtol=1e-4, msg=lambda m: f"{a_key}: {m}")
            assert_close(b_grad, peft_grads[b_key], atol=1e-5, rtol=1e-4, msg=lambda m: f"{b_key}: {m}")
    for name, param in model.named_parameters():
        assert param.requires_grad == (".lora_" in name) and (param.grad is None) != param.requires_grad, name


def test_merged_export_of_expert_adapters_is_the_adapted_model_for_transformers(moe_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    path = moe_checkpoints["qwen3_moe"]
    input_ids, position_ids, cu_seqlens = packed_batch(LENGTHS, vocab_size=VOCAB)
    targets = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(5))
    model = _adapted_model(path, EXPERT_LORA)
    with torch.no_grad():
        ours = _log_probs(model, input_ids, position_ids, cu_seqlens, targets)
    save_hf_checkpoint(model, Layout.single("cpu"), tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert_close(_peft_log_probs(merged, input_ids, cu_seqlens, targets), ours, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def peft_expert_adapter(moe_checkpoints, tmp_path_factory) -> str:
    """A PEFT adapter made by PEFT itself (random A and B) on the experts' down weights and the v projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(6)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(moe_checkpoints["qwen3_moe"], dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["v_proj"],
                                      target_parameters=["mlp.experts.down_proj"], init_lora_weights=False))
    out = tmp_path_factory.mktemp("peft_experts") / "adapter"
    model.save_pretrained(out)
    return str(out)


def _start_from_adapter(path: str, adapter: str, sizes: dict, batch, targets) -> torch.Tensor | None:
    """Log-probs of the model started from the PEFT adapter (the job's reading of its adapter_config.json) on
    `sizes`' layout; the last stage's first TP rank returns them."""
    from shardrl.job.batches import lora_settings
    from tests.test_lora import _forward_logprobs

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = Layout.create(LayoutSpec(world_size=world, **sizes))
    settings = lora_settings(SimpleNamespace(lora_adapter_path=adapter, lora_rank=0), seed=0)
    config = ModelConfig.from_pretrained(path)
    per_stage = config.num_layers // layout.pp_size
    model = Transformer(config, layout, range(layout.pp_rank * per_stage, (layout.pp_rank + 1) * per_stage),
                        layout.is_first_stage, layout.is_last_stage)
    load_hf_weights(model, path)
    attach_lora(model, settings, layout)
    with torch.no_grad():
        log_probs = _forward_logprobs(model, layout, batch, targets)
    return log_probs if layout.is_last_stage and layout.tp_rank == 0 else None


@pytest.mark.parametrize("world, sizes", [(1, {}), pytest.param(4, dict(ep=2, etp=2), marks=pytest.mark.slow),
                                          pytest.param(4, dict(pp=2, ep=2), marks=pytest.mark.slow)],
                         ids=["1", "ep2-etp2", "pp2-ep2"])
def test_expert_adapters_start_from_a_peft_adapter(moe_checkpoints, peft_expert_adapter, world, sizes):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = moe_checkpoints["qwen3_moe"]
    batch = packed_batch(LENGTHS, vocab_size=VOCAB)
    targets = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(7))
    if world == 1:
        results = [_start_from_adapter(path, peft_expert_adapter, sizes, batch, targets)]
    else:
        results = run_distributed(world, _start_from_adapter, path, peft_expert_adapter, sizes, batch, targets)
    ours = [r for r in results if r is not None]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                           peft_expert_adapter)
    with torch.no_grad():
        expected = _peft_log_probs(peft_model, batch[0], batch[2], targets)
    base = hf_logits(path, batch[0], batch[2]).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    assert not torch.allclose(base, expected, atol=1e-3)  # the adapter (its experts' part too) changes the model
    for log_probs in ours:
        assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)


# Training through the actor path (packing, pipeline schedule, PPO loss, gradient finalisation, clipped AdamW), 3
# steps, against the 1-process run. ETP2 splits every expert's F: gate/up's A and down's B are whole on both ETP
# ranks and each sees its F slice only; without their sum over ETP the parameters after 3 steps differ.
EXPERT_LAYOUTS = [  # (world, sizes, distributed optimizer, micro batch size)
    (4, dict(ep=2, etp=2), False, 2),
    pytest.param(2, dict(ep=2), False, 2, marks=pytest.mark.slow),
    pytest.param(4, dict(ep=2, etp=2), True, 2, marks=pytest.mark.slow),
    pytest.param(4, dict(tp=2, ep=2), False, 2, marks=pytest.mark.slow),
    pytest.param(4, dict(pp=2, ep=2), False, 1, marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def expert_trained(tmp_path_factory) -> tuple[str, dict]:
    path = str(make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("lora_experts_train") / "moe",
                                    num_hidden_layers=4))
    return path, train_on_layout(path, {}, False, 2, lora=EXPERT_LORA)


def test_expert_lora_training_changes_the_adapters_only(expert_trained):
    from safetensors.torch import load_file

    path, reference = expert_trained
    assert any(".experts." in name for name in reference["grads"])
    assert all(".lora_" in name for name in reference["grads"])
    original = load_file(f"{path}/model.safetensors")
    base = {name: p for name, p in reference["params"].items() if ".lora_" not in name}
    assert sorted(base) == sorted(original) and all(torch.equal(base[k], original[k]) for k in original)
    for name, p in reference["params"].items():
        if ".lora_B." in name:  # every expert's B trained (every expert got tokens)
            assert not torch.equal(p, torch.zeros_like(p)), name


@pytest.mark.parametrize("world, sizes, distributed_optimizer, micro", EXPERT_LAYOUTS,
                         ids=lambda v: "-".join(f"{d}{n}" for d, n in v.items()) if isinstance(v, dict) else None)
def test_expert_lora_training_at_each_layout_matches_one_process(expert_trained, world, sizes,
                                                                  distributed_optimizer, micro):
    path, reference = expert_trained
    results = run_distributed(world, train_on_layout, path, sizes, distributed_optimizer, micro, None, None, None,
                              EXPERT_LORA)
    check_against_reference(results, reference, distributed_optimizer)


def test_the_rollout_after_a_sync_applies_the_expert_adapters_as_the_merged_export(moe_checkpoints, tmp_path):
    from tests.test_lora import check_rollout_after_sync

    other = make_tiny_checkpoint("qwen3_moe", tmp_path / "other", seed=9, vocab_size=VOCAB)
    check_rollout_after_sync(moe_checkpoints["qwen3_moe"], other, EXPERT_LORA, tmp_path, runtime=False)
