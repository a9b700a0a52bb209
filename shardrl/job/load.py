"""From the composed Hydra tree to a validated `PPOConfig`: resolve interpolations, fold verl's alternative
spellings into ours, build the typed dataclasses (every value checked) and check the rules between keys."""

from __future__ import annotations

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


def load_config(cfg: DictConfig) -> PPOConfig:
    """Resolve interpolations, build the typed config and check the rules that tie keys together."""
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:  # e.g. an interpolation to a missing key
        raise ConfigError(getattr(err, "full_key", None) or "<config>", str(err).splitlines()[0]) from None
    tree = _fold_bypass_mode(_fold_reward_kwargs({k: v for k, v in tree.items() if k != "hydra"}))
    config = build(PPOConfig, tree)
    validate(config)
    return config


def compose(config_name: str = "ppo_trainer", overrides: Sequence[str] = ()) -> PPOConfig:
    """Compose a packaged config with Hydra-style overrides (for tests and scripts; the CLI uses main_ppo)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return load_config(hydra_compose(config_name=config_name, overrides=list(overrides)))


def check_known_key(key: str) -> None:
    """Raise the `did you mean` error when `key` (the key of a command-line `key=value`, which must exist) is neither
    a key nor a group of the schema. An entry of a free-form mapping passes: what the yaml holds there decides."""
    leaves = field_paths(PPOConfig)
    known = {".".join(path.split(".")[:i]) for path in leaves for i in range(1, path.count(".") + 2)}
    if key in known or any(key.startswith(f"{mapping}.") for mapping in mapping_paths(PPOConfig)):
        return
    raise unknown_key(key, leaves)
