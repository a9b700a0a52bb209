"""What the entry point does before Hydra composes the config: `--help` (the configs, the most used keys with their
defaults and docs/config.md's meaning of each, the dry run, how to print the whole config) and the check that every
`key=value` names a key that exists, answered with the closest one (Hydra's own error names no alternative)."""

from __future__ import annotations

from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf

from shardrl.job.errors import ConfigError
from shardrl.job.load import CONFIG_DIR, check_known_key
from shardrl.job.reference import DOC, config_purposes, key_tables, one_line

DEFAULT_CONFIG = "ppo_trainer"
# The keys most runs set, in the order `--help` lists them (each is documented in docs/config.md; a test checks).
HELP_KEYS = (
    "data.train_files", "data.val_files", "data.train_batch_size", "data.max_prompt_length",
    "data.max_response_length", "actor_rollout_ref.model.path", "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "algorithm.adv_estimator",
    "custom_reward_function.path", "trainer.device", "trainer.nnodes", "trainer.n_gpus_per_node",
    "trainer.total_epochs", "trainer.total_training_steps", "trainer.logger", "trainer.experiment_name",
    "trainer.default_local_dir", "trainer.save_freq", "trainer.test_freq",
)
USAGE = "usage: python -m shardrl.trainer.main_ppo [--config-name=NAME] [key=value ...] [+new.key=value ...]"


def check_overrides(overrides: list[str], config_dir: str = str(CONFIG_DIR),
                    config_name: str = DEFAULT_CONFIG) -> None:
    """Raise the `did you mean` ConfigError for the first `key=value` whose key the config does not have, and a
    one-line ConfigError for a `key=value` that changes an entry a free-form mapping does not hold (the config
    `config_name` in `config_dir` composed to see; a new entry needs `+key=value`). Keys an earlier `+key=` added
    count as existing; Hydra's own keys, `key@package=` forms and overrides Hydra cannot parse are left to Hydra,
    which reports them itself."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return
    added: list[str] = []
    entries: list[str] = []  # changed entries of free-form mappings: they must exist already
    for override in parsed:
        key = override.key_or_group
        if override.type is not OverrideType.CHANGE:
            added.append(key)
        elif not (override.package is not None or key.split(".")[0].split("/")[0] == "hydra"
                  or any(key == new or key.startswith(f"{new}.") for new in added)):
            if check_known_key(key):
                entries.append(key)
    if entries:
        _check_mapping_entries(entries, config_dir, config_name)


def add_or_override(overrides: list[str], config_dir: str = str(CONFIG_DIR),
                    config_name: str = DEFAULT_CONFIG) -> list[str]:
    """`overrides` with each `+key=value` whose key the config already holds made `++key=value` (add or override).
    verl adds with `+` the keys its own config lacks (`+actor_rollout_ref.actor.policy_loss.tau_pos=1.0`); where
    shardrl's config has the key, Hydra would refuse to add it again, so the value overrides it instead."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return overrides
    adds = [o for o in parsed if o.type is OverrideType.ADD and o.package is None]
    if not adds:
        return overrides
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            tree = OmegaConf.to_container(compose(config_name=config_name), resolve=False)
    except (HydraException, MissingConfigException):
        return overrides
    held = {o.input_line for o in adds if _holds(tree, o.key_or_group)}
    return [f"+{line}" if line in held else line for line in overrides]


def _holds(tree: dict[str, Any], key: str) -> bool:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _check_mapping_entries(keys: list[str], config_dir: str, config_name: str) -> None:
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            tree = OmegaConf.to_container(compose(config_name=config_name), resolve=False)
    except (HydraException, MissingConfigException):
        return  # a config that does not compose: Hydra reports it when it runs
    for key in keys:
        node: Any = tree
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(key, f"is a new entry of a free-form mapping: add it with +{key}=... (Hydra's "
                                       "`+` adds a key the config does not hold)")
            node = node[part]


def help_text(config_dir: str, config_name: str) -> str:
    """The `--help` page for `config_name` in `config_dir` (defaults as that config composes them)."""
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            tree = OmegaConf.to_container(compose(config_name=config_name), resolve=False)
    except MissingConfigException:
        raise ConfigError("--config-name", f"no config {config_name!r} in {config_dir}; the packaged ones: "
                                           f"{', '.join(sorted(p.stem for p in CONFIG_DIR.glob('*.yaml')))}") from None
    text = DOC.read_text() if DOC.is_file() else ""
    meanings = {key: cells[-1] for key, cells in key_tables(text).get(DEFAULT_CONFIG, {}).items()}
    lines = [USAGE, "",
             "PPO/GRPO post-training with verl's config keys (Hydra). Set any key as group.key=value; a new entry of a "
             "free-form", "mapping (override_config, engine_kwargs, ...) takes a leading +. Every key with its default, "
             "unit and meaning:", f"docs/config.md{'' if text else ' in the shardrl source (not installed here)'}.",
             "", f"configs (--config-name=NAME, files in {CONFIG_DIR}):"]
    for name, purpose in config_purposes(text).items() or [(p.stem, "") for p in sorted(CONFIG_DIR.glob("*.yaml"))]:
        lines.append(f"  {name + (' (default)' if name == DEFAULT_CONFIG else ''):<38} {one_line(purpose, 80)}")
    lines += ["", f"most used keys, with the defaults of {config_name}:"]
    for key in HELP_KEYS:
        lines.append(f"  {key}={_value(tree, key)}")
        if key in meanings:
            lines.append(f"      {one_line(meanings[key])}")
    lines += ["", "before a long run:",
              f"  {'trainer.dry_run=true':<26} {one_line(meanings.get('trainer.dry_run', ''), 80)}",
              f"  {'--cfg job [--resolve]':<26} print the whole composed config (your overrides applied) and exit",
              f"  {'--hydra-help':<26} Hydra's own flags (--multirun, --info, output directories)"]
    return "\n".join(lines)


def _value(tree: dict[str, Any], key: str) -> str:
    """`key`'s value in `tree` as the yaml writes it (null, true, [a, b], ${...})."""
    value: Any = tree
    for part in key.split("."):
        value = value[part]
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)
