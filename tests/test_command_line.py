"""Discoverability of the command line: `--help` lists the configs and the most used keys with their defaults and
docs/config.md's meanings; a key that does not exist fails with one line naming the closest key, exit 2, before
Ray starts (a `+new.key=` is left to the schema, which answers the same way). Two subprocesses; the rest in-process."""

import subprocess
import sys

import pytest

from shardrl.job.build import field_paths
from shardrl.job.errors import ConfigError
from shardrl.job.keys import closest_key
from shardrl.job.load import CONFIG_DIR, compose
from shardrl.job.reference import DOC, key_tables
from shardrl.job.schema import PPOConfig
from shardrl.trainer.command_line import HELP_KEYS, check_overrides, help_text

KEYS = field_paths(PPOConfig)
TYPO = "actor_rollout_ref.rollout.temprature"
DID_YOU_MEAN = f"{TYPO}: unknown key; did you mean actor_rollout_ref.rollout.temperature?"


def main_ppo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardrl.trainer.main_ppo", *args], capture_output=True, text=True,
                          timeout=120)


def test_help_on_the_command_line():
    result = main_ppo("--help")
    assert result.returncode == 0, result.stderr
    assert "ppo_trainer (default)" in result.stdout and "actor_rollout_ref.rollout.n=8" in result.stdout


def test_unknown_key_on_the_command_line_is_one_line_with_the_closest_key():
    result = main_ppo(f"{TYPO}=1", "trainer.dry_run=true")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: {DID_YOU_MEAN}\n")


@pytest.mark.parametrize("key, meant", [
    (TYPO, "actor_rollout_ref.rollout.temperature"),
    ("actor_rollout_ref.rolout.n", "actor_rollout_ref.rollout.n"),  # a group mistyped
    ("trainer.n_gpu_per_node", "trainer.n_gpus_per_node"),
    ("actor_rollout_ref.actor.log_prob_micro_batch_size_per_gpu",  # a key under the wrong group
     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    ("trainer.nonsense", None),
    ("data.train_batch_size.x", None),  # below a leaf
])
def test_closest_key(key, meant):
    assert closest_key(key, KEYS) == meant


def test_check_overrides_refuses_unknown_keys_only():
    with pytest.raises(ConfigError) as info:
        check_overrides(["trainer.dry_run=true", f"{TYPO}=1"])
    assert str(info.value) == DID_YOU_MEAN
    check_overrides(["data=x", "trainer.logger=[console]", "hydra.run.dir=/tmp/x", "hydra/job_logging=disabled",
                     "+ray_kwargs.ray_init.address=auto", "+new.group=1", "new.group=2",  # added, then changed
                     "+actor_rollout_ref.model.override_config.rope_theta=1e6",  # a mapping's new entry
                     "reward.reward_model.rollout.name=vllm",  # an entry the yaml's mapping holds
                     "trainer.total_epochs=1,2", "key with no equals sign"])  # Hydra reports what it cannot parse


def test_changing_an_entry_a_mapping_does_not_hold_asks_for_plus_in_one_line():
    """Hydra's own answer ("Key 'rope_theta' is not in struct", over several lines) is replaced before it composes."""
    key = "actor_rollout_ref.model.override_config.rope_theta"
    with pytest.raises(ConfigError) as info:
        check_overrides(["trainer.dry_run=true", f"{key}=1e6"])
    assert info.value.key == key and f"add it with +{key}=" in str(info.value) and "\n" not in str(info.value)
    done = subprocess.run([sys.executable, "-m", "shardrl.trainer.main_ppo", "trainer.dry_run=true", f"{key}=1e6"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and key in done.stderr


def test_a_new_key_added_with_plus_gets_the_same_answer_from_the_schema():
    with pytest.raises(ConfigError) as info:
        compose("ppo_trainer", [f"+{TYPO}=1"])
    assert str(info.value) == DID_YOU_MEAN


def test_help_lists_every_config_and_each_key_with_its_default_and_meaning():
    meanings = key_tables(DOC.read_text())["ppo_trainer"]
    assert set(HELP_KEYS) <= set(meanings), "every key --help shows is documented in docs/config.md"
    text = help_text(str(CONFIG_DIR), "ppo_megatron_trainer")
    lines = text.splitlines()
    assert all(f"  {p.stem}" in text for p in CONFIG_DIR.glob("*.yaml"))
    assert "  actor_rollout_ref.rollout.n=1" in lines  # this config's default, not ppo_trainer's 8
    assert "      responses per prompt (GRPO group size)" in lines  # the doc's meaning
    assert sum(line.startswith("      ") for line in lines) == len(HELP_KEYS)
    assert any(line.startswith("  trainer.dry_run=true ") for line in lines) and "--cfg job" in text
    with pytest.raises(ConfigError, match="^--config-name: no config 'nope' in .*ppo_trainer$"):
        help_text(str(CONFIG_DIR), "nope")
