"""Checks that only matter when training would start (not in a dry run): files exist, optional packages the config
asks for are installed, the requested device is there. Each failure is one `ConfigError` line naming the key."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from shardrl.job.plan import JobPlan
from shardrl.job.errors import ConfigError

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
    for logger in plan.tracking.loggers:
        if logger in LOGGER_PACKAGES and not _installed(LOGGER_PACKAGES[logger]):
            raise ConfigError("trainer.logger", f"{logger} is not installed (pip install {LOGGER_PACKAGES[logger]}); "
                                                f"remove '{logger}' from trainer.logger")
