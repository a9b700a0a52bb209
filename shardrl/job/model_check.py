"""Model-config checks of the planner: does each role's layout fit the model? Reads `config.json` only, never weights,
and only when the model path is a local directory (a hub id or a missing path skips the checks with a note)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from shardrl.data import builtin_task
from shardrl.job.errors import ConfigError
from shardrl.job.schema import PPOConfig
from shardrl.models.attention import FA4_HEAD_DIMS
from shardrl.models.config import OverrideError, apply_overrides
from shardrl.parallel.layout_spec import LayoutSpec
from shardrl.parallel.lora import LoRASettings

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen-MoE, Mixtral, DeepSeek


def _megatron_keys(group: str) -> dict[str, str]:
    return {"tp": f"{group}.tensor_model_parallel_size", "pp": f"{group}.pipeline_model_parallel_size",
            "ep": f"{group}.expert_model_parallel_size"}


# The config group of each role built from a Megatron-style group (its layout, its override_transformer_config).
MEGATRON_GROUPS = {"actor": "actor_rollout_ref.actor.megatron", "ref": "actor_rollout_ref.ref.megatron",
                   "critic": "critic.megatron", "teacher": "distillation.teacher_model.megatron",
                   "reward_model": "reward_model.megatron"}
# Config keys that set each role's TP / PP / EP, for error messages.
ROLE_KEYS = {
    **{role: _megatron_keys(group) for role, group in MEGATRON_GROUPS.items()},
    "rollout": {"tp": "actor_rollout_ref.rollout.tensor_model_parallel_size",
                "ep": "actor_rollout_ref.rollout.expert_parallel_size"},
    "judge": {"tp": "reward_model.judge.tensor_model_parallel_size"},  # TP only: it splits nothing else
}


def role_keys(role: str) -> dict[str, str]:
    """The config keys that set `role`'s TP / PP / EP; a teacher on the teachers' pool (`teacher/<entry>`) is laid
    out by its entry's `inference` sizes."""
    if role.startswith("teacher/"):
        group = f"distillation.teacher_models.{role.partition('/')[2]}.inference"
        return {"tp": f"{group}.tensor_model_parallel_size", "pp": f"{group}.pipeline_model_parallel_size",
                "ep": f"{group}.expert_parallel_size"}
    return ROLE_KEYS[role]


def read_hf_config(path: str | None, overrides: dict[str, Any], key: str) -> tuple[dict[str, Any], str] | None:
    """config.json of a local model directory `path` with `overrides` (`model.override_config`) applied, and its
    path; else None. `key` names the path's config key for errors."""
    if path is None:
        return None
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        return None
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(key, f"{file} is not valid JSON ({err})") from None
    return with_overrides(hf, overrides, key), str(file)


def with_overrides(hf: dict[str, Any], overrides: dict[str, Any], key: str) -> dict[str, Any]:
    """config.json fields `hf` with `model.override_config` applied; a bad entry is a ConfigError under the group
    of the model's path `key`."""
    group = key.rpartition(".")[0]
    try:
        return apply_overrides(hf, overrides)
    except OverrideError as err:
        raise ConfigError(f"{group}.override_config.{err.field}", str(err).partition(": ")[2] or str(err)) from None


def check_model(config: PPOConfig, specs: dict[str, LayoutSpec], lora: LoRASettings | None = None,
                critic_lora: LoRASettings | None = None,
                teachers: Sequence[tuple[str, str, str]] = ()) -> list[str]:
    """Check every planned role against its model's config.json (`lora`: the actor's adapters, `SharedKeys.lora`;
    `critic_lora`: the critic's; `teachers`: (config key, directory, role) of each distillation teacher); returns one
    note per role for the printout."""
    actor, critic = config.actor_rollout_ref.model, config.critic.model
    rm, judge = config.reward_model.model, config.reward_model.judge
    sources = (("actor_rollout_ref.model.path", actor.path, actor.override_config, ("actor", "ref", "rollout")),
               ("critic.model.path", critic.path, critic.override_config, ("critic",)),
               *((key, path, {}, (role,)) for key, path, role in teachers),
               ("reward_model.model.path", rm.path, rm.override_config, ("reward_model",)),
               ("reward_model.judge.model_path", judge.model_path, {}, ("judge",)))
    # A null actor path (and a null critic path with it) is the built-in task's model, made at launch: its config is
    # known, so it is checked like a directory's.
    builtin = builtin_task.model_config(config.actor_rollout_ref.rollout.multi_turn.enable)
    builtin_keys = ("actor_rollout_ref.model.path", "critic.model.path") if actor.path is None else ()
    notes = []
    for key, path, overrides, names in sources:
        names = [n for n in names if n in specs]
        if not names:
            continue
        adapters = _adapters_of(names, lora, critic_lora)
        if path is None and key in builtin_keys:
            found = with_overrides(builtin, overrides, key), "the built-in tiny model"
        else:
            found = read_hf_config(path, overrides, key)
        if found is None:
            where = f"{path}: no local config.json" if path else f"{key} is null"
            notes.append(f"{'/'.join(names)} model: {where}; model checks skipped")
            continue
        hf, source = found
        notes.extend(f"{name}: {check_layout_fits(hf, source, specs[name], role_keys(name))}" for name in names)
        _refuse_fa4_head_size(config, names, hf, source)
        dense = not any(hf.get(f) for f in EXPERT_COUNT_FIELDS)
        if "actor" in names and dense:
            _refuse_routing_on_dense(config, source)
        if adapters is not None and dense:
            _refuse_expert_lora_on_dense(*adapters, source)
        elif adapters is not None:
            _refuse_mlp_names_without_mlps(*adapters, hf, source)
            if not adapters[0].target_parameters:
                notes.append(f"{names[0]}: LoRA adapters on no routed expert ({adapters[1]}.target_parameters "
                             f"names the experts' weights)")
    return notes


def _refuse_fa4_head_size(config: PPOConfig, roles: list[str], hf: dict[str, Any], source: str) -> None:
    """`attention_backend=fa4` on a model whose head size FlashAttention-4 is not used for (`FA4_HEAD_DIMS`: its
    gradients were wrong at some sizes) fails here, before workers start, rather than on every worker."""
    arr = config.actor_rollout_ref
    groups = {"actor": arr.actor.megatron, "ref": arr.ref.megatron, "critic": config.critic.megatron,
              "teacher": config.distillation.teacher_model.megatron, "reward_model": config.reward_model.megatron}
    heads = hf.get("num_attention_heads")
    head_dim = hf.get("head_dim") or (hf["hidden_size"] // heads if heads and hf.get("hidden_size") else None)
    for role in (r.partition("/")[0] for r in roles):  # a pool teacher takes teacher_model.megatron's settings
        if role in groups and groups[role].override_transformer_config.get("attention_backend") == "fa4" \
                and head_dim is not None and head_dim not in FA4_HEAD_DIMS:
            key = f"{MEGATRON_GROUPS[role]}.override_transformer_config.attention_backend"
            raise ConfigError(key, f"fa4: FlashAttention-4 is used for head_dim in {FA4_HEAD_DIMS} (its gradients "
                                   f"were checked at those), and {source} has {head_dim}; set flash or auto")


def _adapters_of(roles: list[str], lora: LoRASettings | None,
                 critic_lora: LoRASettings | None) -> tuple[LoRASettings, str] | None:
    """The adapters of the model these roles share, and where their keys are."""
    if "actor" in roles and lora is not None:
        return lora, "actor_rollout_ref.model"
    if "critic" in roles and critic_lora is not None:
        return critic_lora, "critic.model"
    return None


def _refuse_expert_lora_on_dense(lora: LoRASettings, prefix: str, source: str) -> None:
    if lora.target_parameters:
        raise ConfigError(f"{prefix}.target_parameters", f"{list(lora.target_parameters)}: {source} has no MoE "
                          f"experts; leave it null (or [])")


def _refuse_mlp_names_without_mlps(lora: LoRASettings, prefix: str, hf: dict[str, Any], source: str) -> None:
    """On an MoE model whose every MLP is routed experts, gate/up/down name no linear (as in PEFT, where the experts
    are stacked parameters that `target_modules` does not reach): a run would train no MLP adapter."""
    dense_mlps = (hf.get("shared_expert_intermediate_size") or hf.get("mlp_only_layers")
                  or hf.get("decoder_sparse_step", 1) > 1)
    named = () if isinstance(lora.target_modules, str) else lora.target_modules
    if not dense_mlps and (mlp := [name for name in ("gate_proj", "up_proj", "down_proj") if name in named]):
        raise ConfigError(f"{prefix}.target_modules", f"{mlp}: {source} is an MoE model whose MLPs are all routed "
                          f"experts; adapt them with {prefix}.target_parameters="
                          f"[mlp.experts.gate_up_proj,mlp.experts.down_proj]")


def _refuse_routing_on_dense(config: PPOConfig, source: str) -> None:
    """Routing replay and recording need routed experts."""
    arr = config.actor_rollout_ref
    for key, value, on in (("actor_rollout_ref.actor.router_replay.mode", arr.actor.router_replay.mode, "replays"),
                           ("actor_rollout_ref.ref.router_replay.mode", arr.ref.router_replay.mode, "replays"),
                           ("actor_rollout_ref.rollout.enable_rollout_routing_replay",
                            arr.rollout.enable_rollout_routing_replay, "records")):
        if value not in ("disabled", False):
            raise ConfigError(key, f"{value} {on} MoE routing, but {source} is a dense model; "
                                   f"use {'disabled' if on == 'replays' else 'false'}")


def check_layout_fits(hf: dict[str, Any], source: str, spec: LayoutSpec, keys: dict[str, str]) -> str:
    """Heads and KV heads vs TP, experts vs EP, layers vs PP x VPP; returns a summary with the padded vocab."""
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads and heads % spec.tp:
        raise ConfigError(keys["tp"], f"TP {spec.tp} does not divide num_attention_heads={heads} of {source}")
    if kv_heads and kv_heads % spec.tp and spec.tp % kv_heads:  # fewer KV heads than TP: replicated, see spec.py
        raise ConfigError(keys["tp"], f"TP {spec.tp} and num_key_value_heads={kv_heads} of {source}: one must "
                                      "divide the other")
    experts = next((hf[f] for f in EXPERT_COUNT_FIELDS if hf.get(f)), None)
    if experts and experts % spec.ep:
        raise ConfigError(keys["ep"], f"EP {spec.ep} does not divide the {experts} experts of {source}")
    layers = hf.get("num_hidden_layers")
    stages = spec.pp * spec.vpp
    if layers and layers % stages:
        raise ConfigError(keys["pp"], f"PP {spec.pp} x VPP {spec.vpp} = {stages} stages do not divide "
                                      f"num_hidden_layers={layers} of {source}")
    parts = [f"{heads} heads / {kv_heads} KV heads over TP{spec.tp}", f"{layers} layers over PP{spec.pp}"]
    if experts:
        parts.append(f"{experts} experts over EP{spec.ep}")
    vocab = hf.get("vocab_size")
    if vocab:
        parts.append(f"vocab {vocab} padded to {math.ceil(vocab / spec.tp) * spec.tp}")
    return ", ".join(parts) + " - fits"
