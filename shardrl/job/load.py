"""From the composed Hydra tree to a validated `PPOConfig`: resolve interpolations, fold verl's alternative
spellings into ours, build the typed dataclasses (every value checked) and check the rules between keys."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardrl.job.build import build, field_paths, mapping_paths, unknown_key
from shardrl.job.errors import ConfigError
from shardrl.job.rules import validate
from shardrl.job.schema import PPOConfig

CONFIG_DIR = Path(__file__).resolve().parent / "config"  # the packaged Hydra configs (verl's names)

# verl's main trainer passes `reward_model.reward_kwargs` to its reward manager; these are its DAPO manager's.
_OVERLONG_KWARGS = ("enable", "len", "penalty_factor", "log")


# verl's other spellings of shardrl keys, folded into them by load_config: verl 0.9's `reward` group (its own
# migration of the older keys, reversed) and verl names for shardrl's collective timeout and sync bucket size.
VERL_SPELLINGS = {
    "reward.num_workers": "custom_reward_function.num_workers",
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.enable_resource_pool": "reward_model.enable_resource_pool",
    "reward.reward_model.n_gpus_per_node": "reward_model.n_gpus_per_node",
    "reward.reward_model.nnodes": "reward_model.nnodes",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.reward_kwargs": "reward_model.reward_kwargs",
    "actor_rollout_ref.nccl_timeout": "trainer.collective_timeout_s",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes":
        "actor_rollout_ref.rollout.weight_sync.bucket_size_mb",
    **{f"actor_rollout_ref.{role}.megatron.router_replay.mode": f"actor_rollout_ref.{role}.router_replay.mode"
       for role in ("actor", "ref")},
    "distillation.teacher_model.model_path": "distillation.teacher_models.teacher_model.model_path",
    **{f"data.{key}": f"actor_rollout_ref.rollout.multi_turn.{key}" for key in ("tool_config_path",
                                                                              "function_tool_path")},
}


_ARR = "actor_rollout_ref"
_FUSED = f"{_ARR}.model.use_fused_kernels"  # log-probs and entropy one chunk of logits at a time
# verl's FSDP engine keys (actor.fsdp_config, ref.fsdp_config, critic.fsdp) and FSDP optimizer keys, folded into the
# Megatron-style keys before interpolations resolve, so that keys defaulting to them follow (the reference's layout
# and dtype default to the actor's). Ulysses sequence parallelism splits every sequence over ranks as context
# parallelism does (the same maths); chunked or recomputed entropy is the fused log-prob path's memory saving.
FSDP_SPELLINGS = {
    **{f"{_ARR}.{role}.fsdp_config.{key}": f"{_ARR}.{role}.megatron.{target}"
       for role in ("actor", "ref")
       for key, target in (("param_offload", "param_offload"), ("seed", "seed"), ("dtype", "dtype"),
                           ("ulysses_sequence_parallel_size", "context_parallel_size"))},
    f"{_ARR}.actor.fsdp_config.optimizer_offload": f"{_ARR}.actor.megatron.optimizer_offload",
    **{f"{_ARR}.{role}.ulysses_sequence_parallel_size": f"{_ARR}.{role}.megatron.context_parallel_size"
       for role in ("actor", "ref")},
    **{f"{_ARR}.{role}.fsdp_config.use_torch_compile": f"{_ARR}.{role}.use_torch_compile" for role in ("actor", "ref")},
    **{f"critic.fsdp.{key}": f"critic.megatron.{target}"
       for key, target in (("param_offload", "param_offload"), ("optimizer_offload", "optimizer_offload"),
                           ("seed", "seed"), ("dtype", "dtype"), ("ulysses_sequence_parallel_size",
                                                                  "context_parallel_size"))},
    "critic.ulysses_sequence_parallel_size": "critic.megatron.context_parallel_size",
    **{f"{group}.optim.{key}": f"{group}.optim.lr_decay_style"
       for group in (f"{_ARR}.actor", "critic") for key in ("lr_scheduler_type", "warmup_style")},
    **{f"{_ARR}.{where}{key}": _FUSED
       for where in ("actor.", "actor.fsdp_config.", "ref.fsdp_config.")
       for key in ("entropy_from_logits_with_chunking", "entropy_checkpointing")},
}
# FSDP2's CPU offload policy: parameters, gradients and optimizer state in host memory between uses.
FSDP_OFFLOAD_POLICY = {f"{_ARR}.actor.fsdp_config.offload_policy": [f"{_ARR}.actor.megatron.{state}_offload" for state
                                                                     in ("param", "grad", "optimizer")],
                       f"{_ARR}.ref.fsdp_config.offload_policy": [f"{_ARR}.ref.megatron.param_offload"],
                       "critic.fsdp.offload_policy": [f"critic.megatron.{state}_offload" for state
                                                      in ("param", "grad", "optimizer")]}


def _fold_fsdp_spellings(cfg: DictConfig) -> None:
    """Fold each of `FSDP_SPELLINGS` / `FSDP_OFFLOAD_POLICY` the user gave (its node differs from the packaged one)
    into its shardrl key, in `cfg` before it resolves. A shardrl key the user also gave another value is refused."""
    packaged = _packaged_defaults()
    given = OmegaConf.to_container(cfg, resolve=False)
    folds = [(source, target) for source, target in FSDP_SPELLINGS.items()]
    folds += [(source, target) for source, targets in FSDP_OFFLOAD_POLICY.items() for target in targets]
    for source, target in folds:
        if _get(given, source) == _get(packaged, source):
            continue
        value = OmegaConf.select(cfg, source)
        if value is None or (source in FSDP_OFFLOAD_POLICY and value is False):
            continue
        if _get(given, target) != _get(packaged, target) and OmegaConf.select(cfg, target) != value:
            raise ConfigError(source, f"{value!r} and {target}={OmegaConf.select(cfg, target)!r} set the same thing "
                                      "(verl's FSDP spelling and shardrl's); set one")
        OmegaConf.update(cfg, target, value)


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = (tree or {}).get(part)
    return tree


def _with(tree: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of `tree` with `value` at `dotted` (the groups on the way copied, the rest shared)."""
    head, _, rest = dotted.partition(".")
    return tree | {head: _with(tree.get(head) or {}, rest, value) if rest else value}


def _refuse_reward_group_extras(tree: dict[str, Any]) -> None:
    """Refuse, naming its key, what verl 0.9's `reward` group has and shardrl has not: a user reward-manager class,
    the reward model's serving engine, sandbox fusion."""
    group = tree.get("reward") or {}
    manager = group.get("reward_manager") or {}
    if manager.get("source") not in (None, "register") or any((manager.get("module") or {}).values()):
        key = "source" if manager.get("source") not in (None, "register") else "module.path"
        raise ConfigError(f"reward.reward_manager.{key}", "a reward-manager class of your own is not loaded here; "
                          "score with reward.custom_reward_function (a function per sample, run in processes of its "
                          "own) and the built-in managers (reward_manager.name: naive, batch, dapo, gdpo)")
    for name, what in (("reward_model.rollout", "the reward model is served by shardrl's trainer-pool engine "
                        "(reward_model.megatron.*; a generative judge: reward_model.judge.*)"),
                       ("sandbox_fusion", "there is no remote sandbox service: run code in the reward function (its "
                        "own processes) or in an agent's code_interpreter tool (shardrl.agents.builtin_tools."
                        "PythonTool, sandboxed)")):
        given = sorted(k for k, v in (_get(group, name) or {}).items() if v is not None)
        if given:
            raise ConfigError(f"reward.{name}.{given[0]}", f"has no counterpart: {what}")


def _fold_spellings(tree: dict[str, Any]) -> dict[str, Any]:
    """Fold each of `VERL_SPELLINGS` given (not null, not empty, not its packaged default) into its shardrl key. One
    whose shardrl key was also set to another value (not its packaged default) is refused: set one."""
    defaults = _packaged_defaults()
    for source, target in VERL_SPELLINGS.items():
        value = _get(tree, source)
        if value is None or value == {} or value == _get(defaults, source):
            continue
        current = _get(tree, target)
        if current != _get(defaults, target) and current != value:
            raise ConfigError(source, f"{value!r} and {target}={current!r} set the same thing (verl's spelling and "
                                      "shardrl's); set one")
        tree = _with(tree, target, value)
    return tree


@functools.cache
def _packaged_defaults() -> dict[str, Any]:
    """The packaged ppo_trainer.yaml as written (interpolations unresolved): the older keys' defaults (read once per
    process; `_fold_spellings` only reads it)."""
    return OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml"), resolve=False)


def _fold_reward_kwargs(tree: dict[str, Any]) -> dict[str, Any]:
    """Move DAPO's overlong shaping from verl's main-trainer spelling (`+reward_model.reward_kwargs.
    overlong_buffer_cfg.*`, `+reward_model.reward_kwargs.max_resp_len`) into `reward_model.overlong_buffer`, the
    spelling of verl's DAPO recipe; set only one. Other reward-manager arguments are refused, as verl's managers do."""
    reward_model = tree.get("reward_model")
    kwargs = dict((reward_model or {}).get("reward_kwargs") or {})
    if not kwargs:
        return tree
    unknown = sorted(set(kwargs) - {"overlong_buffer_cfg", "max_resp_len"})
    if unknown:
        raise ConfigError(f"reward_model.reward_kwargs.{unknown[0]}", "is not a reward-manager argument here; the "
                          "known ones are verl's DAPO manager's: overlong_buffer_cfg.{enable,len,penalty_factor,log} "
                          "and max_resp_len")
    max_length = tree["data"]["max_response_length"]
    if kwargs.get("max_resp_len", max_length) != max_length:
        raise ConfigError("reward_model.reward_kwargs.max_resp_len", f"{kwargs['max_resp_len']} differs from "
                          f"data.max_response_length={max_length}; the overlong buffer ends at the response length")
    shaping = kwargs.get("overlong_buffer_cfg") or {}
    key = "reward_model.reward_kwargs.overlong_buffer_cfg"
    if not isinstance(shaping, dict) or set(shaping) - set(_OVERLONG_KWARGS):
        raise ConfigError(key, f"expected a mapping of {', '.join(_OVERLONG_KWARGS)}; got {shaping!r}")
    if shaping and reward_model["overlong_buffer"]["enable"]:
        raise ConfigError(key, "and reward_model.overlong_buffer.enable=true both set the overlong shaping; set one "
                               "(reward_kwargs.overlong_buffer_cfg: verl's main trainer; overlong_buffer: its DAPO "
                               "recipe)")
    overlong = reward_model["overlong_buffer"] | shaping
    return tree | {"reward_model": reward_model | {"reward_kwargs": {}, "overlong_buffer": overlong}}


def _fold_bypass_mode(tree: dict[str, Any]) -> dict[str, Any]:
    """verl (>= 0.6.1) names the PPO anchor `algorithm.rollout_correction.bypass_mode`: true anchors on the behaviour
    logprobs, our `decoupled=false`. When it is set it decides `decoupled`. verl 0.6.1 named the bypass-mode loss
    `use_policy_gradient` (true: loss_type=reinforce); when set it decides `loss_type`."""
    algorithm = tree.get("algorithm") or {}
    correction = algorithm.get("rollout_correction") or {}
    folded = {}
    for key, value, target, when_true, when_false in (
        ("bypass_mode", correction.get("bypass_mode"), "decoupled", False, True),
        ("use_policy_gradient", correction.get("use_policy_gradient"), "loss_type", "reinforce", "ppo_clip"),
    ):
        if value is None:
            continue
        if not isinstance(value, bool):
            raise ConfigError(f"algorithm.rollout_correction.{key}", f"expected true, false or null, got {value!r}")
        folded[target] = when_true if value else when_false
    if not folded:
        return tree
    return tree | {"algorithm": algorithm | {"rollout_correction": correction | folded}}


def _fold_min_lr(tree: dict[str, Any]) -> dict[str, Any]:
    """verl's Megatron optimizer names the final learning rate absolutely (`optim.min_lr`); shardrl's schedule takes
    it as a fraction of `optim.lr` (`min_lr_ratio`, verl's FSDP spelling). A given min_lr decides the ratio; one above
    lr, or a ratio also set to another value, is refused."""
    for group in ("actor_rollout_ref.actor.optim", "critic.optim"):
        optim = _get(tree, group)
        if optim["min_lr"] is None:
            continue
        min_lr, lr = optim["min_lr"], optim["lr"]
        if min_lr > lr:
            raise ConfigError(f"{group}.min_lr", f"{min_lr} is above {group}.lr={lr}; the schedule decays from lr "
                                                 "down to min_lr")
        ratio = min_lr / lr if lr > 0 else 0.0
        if optim["min_lr_ratio"] != _get(_packaged_defaults(), f"{group}.min_lr_ratio") and \
                not math.isclose(optim["min_lr_ratio"], ratio):
            raise ConfigError(f"{group}.min_lr", f"{min_lr} and {group}.min_lr_ratio={optim['min_lr_ratio']} set the "
                                                 "same final learning rate differently (verl's Megatron and FSDP "
                                                 "spellings); set one")
        tree = _with(tree, group, optim | {"min_lr_ratio": ratio, "min_lr": None})
    return tree


def load_config(cfg: DictConfig) -> PPOConfig:
    """Resolve interpolations, build the typed config and check the rules that tie keys together."""
    try:
        cfg = cfg.copy()
        _fold_fsdp_spellings(cfg)
        tree = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:  # e.g. an interpolation to a missing key
        raise ConfigError(getattr(err, "full_key", None) or "<config>", str(err).splitlines()[0]) from None
    tree = {k: v for k, v in tree.items() if k != "hydra"}
    build(PPOConfig, tree)  # every value checked under the key the user wrote, before any is folded into another
    _refuse_reward_group_extras(tree)
    tree = _fold_min_lr(_fold_bypass_mode(_fold_reward_kwargs(_fold_spellings(tree))))
    config = build(PPOConfig, tree)
    validate(config)
    return config


def compose(config_name: str = "ppo_trainer", overrides: Sequence[str] = ()) -> PPOConfig:
    """Compose a packaged config with Hydra-style overrides (for tests and scripts; the CLI uses main_ppo)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(hydra_compose(config_name=config_name, overrides=list(overrides)))


def check_known_key(key: str) -> bool:
    """Raise the `did you mean` error when `key` (the key of a command-line `key=value`, which must exist) is neither
    a key nor a group of the schema. Returns whether it is an entry of a free-form mapping (then what the yaml holds
    there decides)."""
    leaves = field_paths(PPOConfig)
    known = {".".join(path.split(".")[:i]) for path in leaves for i in range(1, path.count(".") + 2)}
    if key in known:
        return False
    if any(key.startswith(f"{mapping}.") for mapping in mapping_paths(PPOConfig)):
        return True
    raise unknown_key(key, leaves)
