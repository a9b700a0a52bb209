"""Checks that only matter when training would start (not in a dry run): files exist, every model directory holds a
model shardrl can build and weights that load (headers read, no tensor), optional packages the config asks for are
installed, the requested device is there. Each failure is one `ConfigError` line naming the key."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from shardrl.job.errors import ConfigError
from shardrl.job.model_check import MEGATRON_GROUPS
from shardrl.job.options import EngineOptions
from shardrl.job.plan import JobPlan
from shardrl.models.config import ModelConfig, ModelConfigError
from shardrl.models.hf_bridge import CheckpointError, checkpoint_tensor_shapes, uncarried_tensors

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
    for key, path in model_paths(plan):
        check_model_dir(key, path)
    for key, path, options, value_head in ((f"{group}.checkpoint.strict", path, role, group == "critic")
                                           for group, path, role in (
                                               ("actor_rollout_ref.actor", plan.model_path, plan.actor),
                                               ("critic", plan.critic_model_path, plan.critic))
                                           if role is not None and path is not None):
        if options.checkpoint.strict:
            refuse_uncarried_tensors(key, path, options.model.override_config, value_head)
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
    for key, engine in trained_models(plan):
        if engine.fast.attention == "fa4":
            where = f"{key}.override_transformer_config.attention_backend"
            if plan.device != "cuda":
                raise ConfigError(where, f"fa4 runs on CUDA GPUs and this run is on {plan.device} (trainer.device); "
                                         f"set flash or auto")
            if not _installed("flash_attn") or not _installed("flash_attn.cute"):
                raise ConfigError(where, "FlashAttention-4 is not installed (pip install 'shardrl[fa4]'); set flash "
                                         "or auto")
    for logger in plan.tracking.loggers:
        if logger in LOGGER_PACKAGES and not _installed(LOGGER_PACKAGES[logger]):
            raise ConfigError("trainer.logger", f"{logger} is not installed (pip install {LOGGER_PACKAGES[logger]}); "
                                                f"remove '{logger}' from trainer.logger")


def refuse_uncarried_tensors(key: str, path: str, overrides: dict[str, Any], value_head: bool) -> None:
    """verl's `checkpoint.strict`: the HF checkpoint at `path` (already checked by `check_model_dir`) may hold only
    tensors the trained model (config.json with `model.override_config`) carries, so that its exports hold
    everything it started from."""
    directory = Path(path).expanduser()
    dropped = uncarried_tensors(checkpoint_tensor_shapes(directory), ModelConfig.from_pretrained(directory, overrides),
                                value_head)
    if dropped:
        raise ConfigError(key, f"{directory} holds {len(dropped)} tensor(s) the model does not carry (e.g. "
                               f"{dropped[0]!r}), so its exports would lack them; set {key}=false to train and "
                               f"export without them")


def trained_models(plan: JobPlan) -> list[tuple[str, EngineOptions]]:
    """(the role's megatron config key, its model's engine options) of every model the run builds from a
    Megatron-style group: actor, reference, critic, distillation teacher, reward model."""
    built = [(group, getattr(plan, role)) for role, group in MEGATRON_GROUPS.items()]  # plan fields are role names
    return [(group, options.model.engine) for group, options in built if options is not None]


def model_paths(plan: JobPlan) -> list[tuple[str, str]]:
    """(config key, directory) of every model the run loads weights from (the built-in task's model is made at
    launch and left out)."""
    found = [("actor_rollout_ref.model.path", plan.model_path)]
    if plan.critic is not None:
        found.append(("critic.model.path", plan.critic_model_path))
    if plan.teacher is not None:
        found.append(("distillation.teacher_model.model_path", plan.teacher.model_path))
    if plan.reward_model is not None:
        found.append(("reward_model.model.path", plan.reward_model_path))
    if plan.judge is not None:
        found.append(("reward_model.judge.model_path", plan.judge.model_path))
    return [(key, path) for key, path in found if path is not None]


def check_model_dir(key: str, path: str) -> None:
    """A local directory with a config.json shardrl can build a model from and safetensors weights whose headers
    parse, whose files are whole, and whose embedding fits config.json's vocabulary and width."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(key, f"{path} is not a local model directory; download the model first (e.g. "
                               f"`huggingface-cli download <repo> --local-dir <dir>`) and pass that directory")
    try:
        config = ModelConfig.from_pretrained(directory)
        shapes = checkpoint_tensor_shapes(directory)
    except (ModelConfigError, CheckpointError) as err:
        message = str(err)
        raise ConfigError(key, message if message.startswith(str(directory)) else f"{directory}: {message}") from None
    embedding = shapes.get("model.embed_tokens.weight")
    if embedding is not None and embedding != (config.vocab_size, config.hidden_size):
        raise ConfigError(key, f"{directory}: model.embed_tokens.weight has shape {embedding}, config.json says "
                               f"vocab_size x hidden_size = ({config.vocab_size}, {config.hidden_size}); the "
                               f"weights and config.json are not of one model")
