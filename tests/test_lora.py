"""LoRA adapters (`shardrl.parallel.lora`) against PEFT on transformers: with the same A and B, the log-probs and every
adapter's gradient equal PEFT's, at one process and at TP2 (sequence parallelism off and on; Qwen2's odd vocabulary
padded over TP), and PP2's log-probs too; the base weights get no gradient and adapters switched off give the base
model. A and B are drawn whole from their names, so every layout starts from the same adapters."""

import dataclasses
import json
import zlib

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.testing import assert_close

from shardrl.models.config import ModelConfig
from shardrl.models.hf_bridge import load_hf_weights
from shardrl.models.tiny import make_tiny_checkpoint, packed_batch
from shardrl.models.transformer import Transformer
from shardrl.parallel.launch import run_distributed
from shardrl.parallel.layout import Layout
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.lora import LoRASettings, adapters_disabled, attach_lora, lora_parameters
from shardrl.parallel.spec import get_spec
from shardrl.parallel.tensor import token_split_sizes
from tests.test_parity_matrix import check_against_reference, train_on_layout

SETTINGS = LoRASettings(rank=4, alpha=8.0, seed=7)
LENGTHS = [6, 3, 8]
VOCAB = 127  # odd: Qwen2's embedding and LM head are padded to 128 rows at TP2


def full_b(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A nonzero B for the adapter `name` (training starts from B = 0, which would hide a wrong B path)."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * 0.3


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    spec = get_spec(param)
    if spec.dim is None:
        return full
    start, stop = spec.slice_range()
    return full.narrow(spec.dim, start, stop - start)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {family: make_tiny_checkpoint(family, root / family, vocab_size=VOCAB) for family in ("qwen2", "llama")}


def peft_reference(path, adapters: dict[str, torch.Tensor], batch, targets) -> tuple[torch.Tensor, dict]:
    """PEFT's LoRA on the transformers model with our A and B: per-token log-probs [T] of `targets` and the gradient
    of their sum w.r.t. every adapter tensor (by our names)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=SETTINGS.rank, lora_alpha=SETTINGS.alpha,
                                                  target_modules="all-linear", lora_dropout=0.0))
    params = dict(peft_model.named_parameters())
    ours_to_peft = {name: "base_model.model." + name.replace(".weight", ".default.weight") for name in adapters}
    assert sorted(ours_to_peft.values()) == sorted(n for n in params if ".lora_" in n)  # the same set of adapters
    with torch.no_grad():
        for name, value in adapters.items():
            params[ours_to_peft[name]].copy_(value)
    input_ids, _, cu_seqlens = batch
    bounds = cu_seqlens.tolist()
    logits = torch.cat([peft_model(input_ids[a:b].unsqueeze(0)).logits[0] for a, b in zip(bounds, bounds[1:])])
    log_probs = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    log_probs.sum().backward()
    return log_probs.detach(), {name: params[peft].grad for name, peft in ours_to_peft.items()}


def our_pass(path, layout: Layout, sequence_parallel: bool, batch, targets):
    """Our model with adapters (B set to `full_b`) on this rank: (log-probs [T] or None off the last stage, full
    adapter gradients by name (TP-reduced and gathered; None at PP > 1), full A and B by name, base log-probs)."""
    config = ModelConfig.from_pretrained(path)
    per_stage = config.num_layers // layout.pp_size
    first = layout.pp_rank * per_stage
    model = Transformer(config, layout, range(first, first + per_stage), layout.is_first_stage,
                        layout.is_last_stage, sequence_parallel=sequence_parallel)
    load_hf_weights(model, path)
    attach_lora(model, SETTINGS, layout)
    with torch.no_grad():
        for param in lora_parameters(model):
            name = get_spec(param).hf_name
            if ".lora_B." in name:
                param.copy_(local_slice(full_b(name, get_spec(param).full_shape), param))
    run = (lambda: _forward_logprobs(model, layout, batch, targets))
    log_probs = run()
    if layout.pp_size == 1:
        log_probs.sum().backward()
    with torch.no_grad(), adapters_disabled([model]):
        base = run()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    full_values, full_grads = {}, {}
    for param in lora_parameters(model):
        name = get_spec(param).hf_name
        full_values[name] = _gather(param.detach(), param, layout)
        if layout.pp_size == 1:
            full_grads[name] = _gather(_reduced(param.grad, param, layout), param, layout)
    return (None if log_probs is None else log_probs.detach(), full_grads, full_values,
            None if base is None else base.detach())


def _forward_logprobs(model: Transformer, layout: Layout, batch, targets) -> torch.Tensor | None:
    input_ids, position_ids, cu_seqlens = batch
    num_tokens = input_ids.shape[0]
    x = input_ids
    if not layout.is_first_stage:
        local = token_split_sizes(num_tokens, layout.tp_size)[layout.tp_rank] if model.sequence_parallel else num_tokens
        x = torch.empty(local, model.config.hidden_size)
        dist.recv(x, src=layout.group_ranks["pp"][layout.pp_rank - 1])
    hidden = model(x, position_ids, cu_seqlens)
    if not layout.is_last_stage:
        dist.send(hidden.detach().contiguous(), dst=layout.group_ranks["pp"][layout.pp_rank + 1])
        return None
    log_probs, _ = model.compute_logprobs(hidden, targets)
    return log_probs


def _reduced(grad: torch.Tensor, param: torch.Tensor, layout: Layout) -> torch.Tensor:
    grad = grad.clone()
    if get_spec(param).sum_grad_over_group and layout.tp_group is not None:
        dist.all_reduce(grad, group=layout.tp_group)
    return grad


def _gather(local: torch.Tensor, param: torch.Tensor, layout: Layout) -> torch.Tensor:
    spec = get_spec(param)
    if spec.dim is None or spec.num_shards == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(layout.tp_size)]
    dist.all_gather(pieces, local.contiguous(), group=layout.tp_group)
    return torch.cat(pieces, dim=spec.dim)


def _batch():
    batch = packed_batch(LENGTHS, vocab_size=VOCAB)
    targets = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(3))
    return batch, targets


def test_adapters_equal_peft_at_one_process_and_switch_off_to_the_base_model(checkpoints):
    batch, targets = _batch()
    for family, path in checkpoints.items():
        log_probs, grads, values, base = our_pass(path, Layout.single("cpu"), False, batch, targets)
        expected, expected_grads = peft_reference(path, values, batch, targets)
        assert_close(log_probs, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{family}: {m}")
        assert not torch.allclose(base, expected, atol=1e-3)  # B != 0: the adapters change the model
        for name, grad in expected_grads.items():
            assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{family} {name}: {m}")
        # Switched off, the adapters leave the base model: transformers' own log-probs.
        from shardrl.models.tiny import hf_logits

        hf = hf_logits(path, batch[0], batch[2]).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        assert_close(base, hf, atol=1e-5, rtol=1e-5)


def _run_layouts(checkpoints, batch, targets):
    from shardrl.parallel.layout import GroupRegistry

    registry = GroupRegistry()
    out = []
    for name, sizes, sequence_parallel in (("tp2", dict(tp=2), False), ("tp2+sp", dict(tp=2), True),
                                           ("pp2", dict(pp=2), False)):
        layout = Layout.create(LayoutSpec(world_size=2, **sizes), registry=registry)
        for family, path in checkpoints.items():
            out.append((name, family, our_pass(path, layout, sequence_parallel, batch, targets)))
    return out


def test_adapters_at_tp2_sp_and_pp2_equal_peft(checkpoints):
    batch, targets = _batch()
    ranks = run_distributed(2, _run_layouts, checkpoints, batch, targets)
    references, initial = {}, {}
    for (name, family, (log_probs, grads, values, _)), (_, _, (other_lp, _, other_values, _)) in zip(ranks[1],
                                                                                                    ranks[0]):
        if family not in references:  # tp2 runs first: every adapter, gathered whole
            initial[family] = values
            references[family] = peft_reference(checkpoints[family], values, batch, targets)
        # The adapters a layout starts from do not depend on it (PP2: each stage holds its layers' own).
        merged = {**other_values, **values}
        assert sorted(merged) == sorted(initial[family])
        assert all(torch.equal(merged[k], initial[family][k]) for k in merged), (name, family)
        expected, expected_grads = references[family]
        # TP ranks both hold the log-probs; at PP2 the last stage (rank 1) does.
        assert_close(log_probs, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} {family}: {m}")
        if name.startswith("tp"):
            assert_close(other_lp, expected, atol=1e-5, rtol=1e-5)
            for param, grad in expected_grads.items():
                assert_close(grads[param], grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name} {family} {param}: {m}")


# Training through the actor path (packing, pipeline schedule, PPO loss, gradient finalisation, clipped AdamW), 3
# steps: every layout gives the 1-process run's losses, adapter gradients and parameters; the MoE model's adapters sit
# on its attention (expert adapters are not built yet).
DENSE_LORA = LoRASettings(rank=4, alpha=8.0, seed=3)
MOE_LORA = LoRASettings(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=3)
LORA_LAYOUTS = [  # (model kind, world, sizes, distributed optimizer, micro batch size)
    ("dense", 2, dict(tp=2), False, 2),
    ("dense", 2, dict(cp=2), False, 2),
    pytest.param("dense", 2, dict(pp=2), False, 1, marks=pytest.mark.slow),
    pytest.param("dense", 2, dict(pp=2, vpp=2), False, 1, marks=pytest.mark.slow),
    pytest.param("dense", 2, {}, True, 2, marks=pytest.mark.slow),
    pytest.param("moe", 2, dict(ep=2), False, 2, marks=pytest.mark.slow),
    pytest.param("dense", 4, dict(tp=2, pp=2), False, 1, marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """Per model kind: the checkpoint and its 1-process LoRA training run."""
    root = tmp_path_factory.mktemp("lora_train")
    out = {}
    for kind, family in (("dense", "qwen2"), ("moe", "qwen3_moe")):
        path = str(make_tiny_checkpoint(family, root / kind, num_hidden_layers=4))
        out[kind] = path, train_on_layout(path, {}, False, 2, lora=_settings(kind))
    return out


def _settings(kind: str) -> LoRASettings:
    return DENSE_LORA if kind == "dense" else MOE_LORA


def test_lora_training_changes_the_adapters_only(trained):
    for kind, (path, reference) in trained.items():
        assert reference["grads"] and all(".lora_" in name for name in reference["grads"]), kind
        original = load_file(f"{path}/model.safetensors")
        base = {name: p for name, p in reference["params"].items() if ".lora_" not in name}
        assert sorted(base) == sorted(original) and all(torch.equal(base[k], original[k]) for k in original), kind
        assert all(not torch.equal(p, torch.zeros_like(p)) for n, p in reference["params"].items() if ".lora_B." in n)


def _lora_layout_id(kind, world, sizes, distributed_optimizer, _micro) -> str:
    return "-".join([kind, *(f"{d}{n}" for d, n in sizes.items()), f"w{world}",
                     *(["distopt"] if distributed_optimizer else [])])


@pytest.mark.parametrize("kind, world, sizes, distributed_optimizer, micro", LORA_LAYOUTS,
                         ids=[_lora_layout_id(*(p.values if hasattr(p, "values") else p)) for p in LORA_LAYOUTS])
def test_lora_training_at_each_layout_matches_one_process(trained, kind, world, sizes, distributed_optimizer, micro):
    path, reference = trained[kind]
    results = run_distributed(world, train_on_layout, path, sizes, distributed_optimizer, micro, None, None, None,
                              _settings(kind))
    check_against_reference(results, reference, distributed_optimizer)


def hf_response_log_probs(model, batch) -> torch.Tensor:
    """[B, R] log-probs of each row's response tokens under a transformers model, each row run on its own."""
    from tests.test_parity_matrix import PROMPT

    t = batch.tensors
    out = torch.zeros_like(t["response_mask"])
    with torch.no_grad():
        for row, (ids, attention) in enumerate(zip(t["input_ids"], t["attention_mask"].bool())):
            tokens = ids[attention]
            prompt = int(attention[:PROMPT].sum())
            log_probs = model(tokens[None]).logits[0].log_softmax(-1)
            n = len(tokens) - prompt
            out[row, :n] = log_probs[prompt - 1:len(tokens) - 1].gather(-1, tokens[prompt:, None])[:, 0]
    return out


@pytest.mark.parametrize("sizes", [dict(tp=2), pytest.param(dict(pp=2), marks=pytest.mark.slow)],
                         ids=["tp2", "pp2"])
def test_trained_adapters_export_as_peft_and_merged_models_transformers_load(trained, tmp_path, sizes):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.test_parity_matrix import make_batch

    path, _ = trained["dense"]
    results = run_distributed(2, train_on_layout, path, sizes, False, 1, None, None, None, DENSE_LORA, tmp_path)
    ours = next(r for r in results if r is not None)["final_log_probs"]
    batch = make_batch()
    mask = batch.tensors["response_mask"].bool()
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                           tmp_path / "peft")
    assert_close(hf_response_log_probs(peft_model, batch)[mask], ours[mask], atol=1e-4, rtol=1e-4)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert_close(hf_response_log_probs(merged, batch)[mask], ours[mask], atol=1e-4, rtol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not torch.allclose(hf_response_log_probs(base, batch)[mask], ours[mask], atol=1e-3)  # it trained


@pytest.fixture(scope="module")
def peft_adapter(checkpoints, tmp_path_factory) -> tuple[str, str]:
    """A PEFT adapter (random A and B, three of the seven projections) saved for the Qwen2 checkpoint."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    path = checkpoints["qwen2"]
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(
        r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    out = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(out)
    return str(path), str(out)


def _start_from_adapter(path: str, adapter: str, sizes: dict, batch, targets) -> torch.Tensor | None:
    from shardrl.parallel.layout import GroupRegistry

    layout = Layout.create(LayoutSpec(world_size=max(1, dist.get_world_size() if dist.is_initialized() else 1),
                                      **sizes), registry=GroupRegistry())
    config = ModelConfig.from_pretrained(path)
    per_stage = config.num_layers // layout.pp_size
    first = layout.pp_rank * per_stage
    model = Transformer(config, layout, range(first, first + per_stage), layout.is_first_stage,
                        layout.is_last_stage)
    load_hf_weights(model, path)
    attach_lora(model, LoRASettings(4, 12.0, ("q_proj", "v_proj", "down_proj"), initial=adapter), layout)
    with torch.no_grad():
        return _forward_logprobs(model, layout, batch, targets)


def _peft_log_probs(path: str, adapter: str, batch, targets) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter)
    input_ids, _, cu_seqlens = batch
    bounds = cu_seqlens.tolist()
    with torch.no_grad():
        logits = torch.cat([model(input_ids[a:b][None]).logits[0] for a, b in zip(bounds, bounds[1:])])
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]


def test_adapters_start_from_a_peft_adapter(peft_adapter):
    path, adapter = peft_adapter
    batch, targets = _batch()
    expected = _peft_log_probs(path, adapter, batch, targets)
    from shardrl.models.tiny import hf_logits

    base = hf_logits(path, batch[0], batch[2]).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    assert not torch.allclose(base, expected, atol=1e-3)  # the adapter changes the model
    assert_close(_start_from_adapter(path, adapter, {}, batch, targets), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_adapters_start_from_a_peft_adapter_at_tp2_and_pp2(peft_adapter, sizes):
    path, adapter = peft_adapter
    batch, targets = _batch()
    out = run_distributed(2, _start_from_adapter, path, adapter, sizes, batch, targets)
    assert_close(out[1], _peft_log_probs(path, adapter, batch, targets), atol=1e-5, rtol=1e-5)


def test_a_lora_checkpoint_holds_the_adapters_alone_and_resumes_exactly(tmp_path):
    """2 steps, save, a fresh engine loads it (its base from the HF model) and takes a 3rd: bitwise the run of 3
    straight steps. The checkpoint's model part is the adapters only."""
    from shardrl.job.options import EngineOptions, OptimOptions, UpdateOptions
    from shardrl.models.checkpoint import load_checkpoint, save_checkpoint, saved_model_tensors
    from shardrl.models.hf_bridge import export_hf_weights
    from shardrl.workers.actor import update_policy
    from shardrl.workers.engine import ModelEngine
    from tests.test_parity_matrix import BATCH, LOSS, make_batch

    path = str(make_tiny_checkpoint("qwen2", tmp_path / "model", num_hidden_layers=2))
    batch, update = make_batch(), UpdateOptions(mini_batch_size=BATCH // 2, micro_batch_size=2)

    def engine() -> ModelEngine:
        return ModelEngine(ModelConfig.from_pretrained(path), Layout.single("cpu"),
                           EngineOptions(optim=OptimOptions(lr=1e-2, eps=1e-3, total_steps=10), lora=DENSE_LORA),
                           hf_path=path)

    def trained(e: ModelEngine, steps: int) -> dict[str, torch.Tensor]:
        for _ in range(steps):
            update_policy(e, batch, LOSS, update)
        return {name: t.clone() for name, t in export_hf_weights(e.chunks, e.layout)}

    straight = trained(engine(), 3)
    first = engine()
    trained(first, 2)
    save_checkpoint(tmp_path / "ckpt", first.chunks, first.layout, optimizer=first.optimizer,
                    scheduler=first.scheduler)
    assert sorted(saved_model_tensors(tmp_path / "ckpt")) == sorted(n for n in straight if ".lora_" in n)
    resumed = engine()
    load_checkpoint(tmp_path / "ckpt", resumed.chunks, resumed.layout, optimizer=resumed.optimizer,
                    scheduler=resumed.scheduler)
    after = trained(resumed, 1)
    assert sorted(after) == sorted(straight) and all(torch.equal(after[k], straight[k]) for k in straight)
    from shardrl.models.convert import dist_to_hf
    from shardrl.models.hf_bridge import CheckpointError

    with pytest.raises(CheckpointError, match="LoRA adapters only"):  # no base in it to convert
        dist_to_hf(tmp_path / "ckpt", tmp_path / "hf")


def test_a_lora_critic_trains_its_adapters_and_value_head_and_resumes_exactly(tmp_path):
    """The critic with adapters (`critic.model.lora_rank`): the adapters and the new value head train, every base
    weight stays as loaded; its checkpoint holds exactly those, and 2 steps + save + load + 1 step are bitwise 3
    straight steps."""
    from safetensors.torch import load_file as load_tensors

    from shardrl.job.options import EngineOptions, OptimOptions, UpdateOptions
    from shardrl.models.checkpoint import load_checkpoint, save_checkpoint, saved_model_tensors
    from shardrl.models.hf_bridge import export_hf_weights
    from shardrl.workers.critic import update_critic
    from shardrl.workers.engine import ModelEngine
    from tests.test_parity_matrix import BATCH, RESPONSE, make_batch

    path = str(make_tiny_checkpoint("qwen2", tmp_path / "model", num_hidden_layers=2))
    batch, update = make_batch(), UpdateOptions(mini_batch_size=BATCH // 2, micro_batch_size=2)
    mask = batch.tensors["response_mask"]
    generator = torch.Generator().manual_seed(0)
    batch.tensors["values"] = torch.randn(BATCH, RESPONSE, generator=generator) * mask
    batch.tensors["returns"] = torch.randn(BATCH, RESPONSE, generator=generator) * mask

    def engine() -> ModelEngine:
        options = EngineOptions(value_head=True, optim=OptimOptions(lr=1e-2, eps=1e-3, total_steps=10),
                                lora=DENSE_LORA)
        return ModelEngine(ModelConfig.from_pretrained(path), Layout.single("cpu"), options, hf_path=path,
                           optional_weights=["score.weight"])

    def trained(e: ModelEngine, steps: int) -> dict[str, torch.Tensor]:
        for _ in range(steps):
            update_critic(e, batch, update, "token-mean", 0.5, RESPONSE)
        return {name: t.clone() for name, t in export_hf_weights(e.chunks, e.layout)}

    first = engine()
    trainable = {get_spec(p).hf_name for p in first.chunks[0].parameters() if p.requires_grad}
    assert "score.weight" in trainable and all(n == "score.weight" or ".lora_" in n for n in trainable)
    initial = {name: t.clone() for name, t in export_hf_weights(first.chunks, first.layout)}
    straight = trained(engine(), 3)
    original = load_tensors(f"{path}/model.safetensors")
    for name, value in straight.items():
        if name in original:  # the base: as loaded
            assert torch.equal(value, original[name]), name
        elif ".lora_B." in name or name == "score.weight":  # B starts at 0; the head from its init
            assert not torch.equal(value, initial[name]), name
    trained(first, 2)
    save_checkpoint(tmp_path / "ckpt", first.chunks, first.layout, optimizer=first.optimizer,
                    scheduler=first.scheduler)
    assert sorted(saved_model_tensors(tmp_path / "ckpt")) == sorted(trainable)
    resumed = engine()
    load_checkpoint(tmp_path / "ckpt", resumed.chunks, resumed.layout, optimizer=resumed.optimizer,
                    scheduler=resumed.scheduler)
    after = trained(resumed, 1)
    assert sorted(after) == sorted(straight) and all(torch.equal(after[k], straight[k]) for k in straight)


@pytest.mark.parametrize("runtime", [False, True], ids=["folded", "runtime"])
def test_the_rollout_after_a_sync_generates_what_an_engine_of_the_merged_export_generates(checkpoints, tmp_path,
                                                                                          runtime):
    path, other = checkpoints["qwen2"], make_tiny_checkpoint("qwen2", tmp_path / "other", seed=9, vocab_size=VOCAB)
    check_rollout_after_sync(path, other, SETTINGS, tmp_path, runtime)


def check_rollout_after_sync(path: str, other: str, settings: LoRASettings, tmp_path, runtime: bool) -> None:
    """An engine that starts from other base weights (`other`), synced from a LoRA actor (first sync: every
    tensor), then synced again after the adapters moved (adapters only), twice: each time it generates the tokens
    an engine built from the merged HF export generates, greedy and sampled. Folding the adapters into its weights
    (the default) computes what the export computes: log-probs equal exactly; in the forward (`runtime`) they
    equal up to fp32 rounding. A fold from the folded weights instead of the pristine base fails the later
    rounds."""
    from shardrl.job.options import EngineOptions
    from shardrl.models.hf_bridge import save_hf_checkpoint
    from shardrl.parallel.layout import GroupRegistry
    from shardrl.rollout.engine import Engine, EngineConfig
    from shardrl.rollout.request import SamplingParams
    from shardrl.sync.colocated import ColocatedSync
    from shardrl.workers.engine import ModelEngine

    registry = GroupRegistry()
    layout = Layout.create(LayoutSpec(world_size=1), registry=registry)
    actor = ModelEngine(ModelConfig.from_pretrained(path), layout, EngineOptions(lora=settings), hf_path=path)
    config = EngineConfig(max_model_len=32, cpu_kv_cache_tokens=96, max_num_batched_tokens=64)
    engine = Engine.from_pretrained(other, Layout.create(LayoutSpec(world_size=1), registry=registry),
                                    dataclasses.replace(config, lora=settings, lora_runtime=runtime))
    sync = ColocatedSync(actor.chunks, actor.layout, actor.host_buffers, engine, 8 << 10)
    prompts = [[1, 5, 7, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 2], [20, 21, 22]]
    sampling = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)]
    for round_, scale in enumerate((1.0, -0.5, 0.7)):
        with torch.no_grad():
            for param in lora_parameters(actor.chunks[0]):
                name = get_spec(param).hf_name
                if ".lora_B." in name:
                    param.copy_(full_b(name, param.shape) * scale)
        metrics = sync.sync()
        if round_:
            assert metrics["sync/bytes"] == sum(p.numel() * 4 for p in lora_parameters(engine.model))
        save_hf_checkpoint(actor.chunks, actor.layout, tmp_path / f"merged{round_}")
        reference = Engine.from_pretrained(tmp_path / f"merged{round_}", engine.layout, config)
        for params in sampling:
            ours, theirs = engine.generate(prompts, [params] * 3), reference.generate(prompts, [params] * 3)
            assert [o.token_ids for o in ours] == [o.token_ids for o in theirs], (round_, params)
            tolerance = dict(atol=1e-4, rtol=1e-4) if runtime else dict(atol=0, rtol=0)
            assert_close(torch.tensor([o.logprobs for o in ours]), torch.tensor([o.logprobs for o in theirs]),
                         **tolerance)
