"""Checks that only matter when training would start (not in a dry run): files exist, optional packages the config
asks for are installed, the requested device is there. Each failure is one `ConfigError` line naming the key."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from shardrl.job.plan import JobPlan
from shardrl.job.errors import ConfigError

ROLLOUT_PACKAGES = {"vllm": "vllm", "sglang": "sglang"}  # rollout.name -> package it needs
LOGGER_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_launch(plan: JobPlan) -> None:
    """Raise ConfigError for the first thing that would make the launch fail."""
    if plan.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", "cuda requested but no CUDA device is visible; use trainer.device=auto "
                                            "or cpu")
    data = plan.data
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for path in files or []:
            if not Path(path).expanduser().is_file():
                raise ConfigError(key, f"{path} does not exist")
    reward_path = plan.reward.custom_path
    if reward_path is not None and not Path(reward_path).expanduser().is_file():
        raise ConfigError("custom_reward_function.path", f"{reward_path} does not exist")
    engine = plan.rollout.engine_name
    if engine in ROLLOUT_PACKAGES:
        if not _installed(ROLLOUT_PACKAGES[engine]):
            raise ConfigError("actor_rollout_ref.rollout.name", f"{engine} is not installed (pip install "
                                                                f"{ROLLOUT_PACKAGES[engine]}); use "
                                                                "actor_rollout_ref.rollout.name=native")
        # Installed or not, there is no backend for it yet: never let the native engine run in its place unsaid.
        raise ConfigError("actor_rollout_ref.rollout.name", f"{engine} is installed but shardrl has no {engine} "
                                                            "backend yet; use actor_rollout_ref.rollout.name=native")
    for logger in plan.tracking.loggers:
        if logger in LOGGER_PACKAGES and not _installed(LOGGER_PACKAGES[logger]):
            raise ConfigError("trainer.logger", f"{logger} is not installed (pip install {LOGGER_PACKAGES[logger]}); "
                                                f"remove '{logger}' from trainer.logger")
