"""Checks that only matter when training would start (not in a dry run): files exist, every model directory holds a
model shardrl can build and weights that load (headers read, no tensor), optional packages the config asks for are
installed, the requested device is there. Each failure is one `ConfigError` line naming the key."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from shardrl.job.errors import ConfigError
from shardrl.job.model_check import MEGATRON_GROUPS
from shardrl.job.options import EngineOptions, ModelOptions
from shardrl.job.plan import JobPlan
from shardrl.models.config import ModelConfig, ModelConfigError
from shardrl.models.hf_bridge import CheckpointError, checkpoint_tensor_shapes, ignored_tensor, model_tensor_shapes

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
    check_model_weights(plan)
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


def weight_sources(plan: JobPlan) -> list[tuple[str, str, ModelOptions, frozenset[str], str | None]]:
    """(config key of the directory, the directory, the model's options, the tensors it may lack, the key of its
    verl `checkpoint.strict` or None) of every trained or scoring model that loads HF weights (not random-initialised,
    not from a distributed checkpoint): the policy (and the reference, which loads the same), the critic (a causal
    LM's directory lacks its value head, which then starts random), the distillation teacher, the reward model."""
    found = []
    if plan.model_path is not None:
        found.append(("actor_rollout_ref.model.path", plan.model_path, plan.actor.model, frozenset(),
                      "actor_rollout_ref.actor.checkpoint.strict" if plan.actor.checkpoint.strict else None))
    if plan.critic is not None and plan.critic_model_path is not None:
        found.append(("critic.model.path", plan.critic_model_path, plan.critic.model, frozenset({"score.weight"}),
                      "critic.checkpoint.strict" if plan.critic.checkpoint.strict else None))
    if plan.teacher is not None:
        found.extend((t.path_key, t.model_path, t.model, frozenset(), None) for t in plan.teacher.by_key.values())
    if plan.reward_model is not None:
        found.append(("reward_model.model.path", plan.reward_model_path, plan.reward_model.model, frozenset(), None))
    return [entry for entry in found if entry[2].load_weight and entry[2].dist_checkpoint is None]


def check_model_weights(plan: JobPlan) -> None:
    """Every model of `weight_sources` finds each tensor it needs in its directory (already checked by
    `check_model_dir`), in the shape it needs, as the worker building it would; and where verl's `checkpoint.strict`
    is on, nothing it does not carry (its exports would lack it). One ConfigError line naming the key."""
    for key, path, model, optional, strict_key in weight_sources(plan):
        directory = Path(path).expanduser()
        config, value_head = ModelConfig.from_pretrained(directory, model.override_config), model.engine.value_head
        shapes, expected = checkpoint_tensor_shapes(directory), model_tensor_shapes(config, value_head)
        if missing := [name for name in expected if name not in shapes and name not in optional]:
            raise ConfigError(key, f"{directory} lacks {len(missing)} tensor(s) the model needs (e.g. {missing[0]!r}); "
                                   f"its weights and config.json (with model.override_config) are not of one model")
        for name, shape in expected.items():
            if name in shapes and shapes[name] != shape:
                raise ConfigError(key, f"{directory}: tensor {name!r} has shape {shapes[name]}, the model expects "
                                       f"{shape}; its weights and config.json (with model.override_config) are not "
                                       f"of one model")
        dropped = [name for name in shapes if name not in expected and not ignored_tensor(name, config, value_head)]
        if strict_key is not None and dropped:
            raise ConfigError(strict_key, f"{directory} holds {len(dropped)} tensor(s) the model does not carry (e.g. "
                                          f"{sorted(dropped)[0]!r}), so its exports would lack them; set "
                                          f"{strict_key}=false to train and export without them")


def trained_models(plan: JobPlan) -> list[tuple[str, EngineOptions]]:
    """(the role's megatron config key, its model's engine options) of every model the run builds from a
    Megatron-style group: actor, reference, critic, distillation teacher, reward model."""
    built = [(group, getattr(plan, role)) for role, group in MEGATRON_GROUPS.items() if role != "teacher"]
    if plan.teacher is not None:  # plan fields are role names; the teachers are a set of them
        built += [(MEGATRON_GROUPS["teacher"], teacher) for teacher in plan.teacher.by_key.values()]
    return [(group, options.model.engine) for group, options in built if options is not None]


def model_paths(plan: JobPlan) -> list[tuple[str, str]]:
    """(config key, directory) of every model the run loads weights from (the built-in task's model is made at
    launch and left out)."""
    found = [("actor_rollout_ref.model.path", plan.model_path)]
    if plan.critic is not None:
        found.append(("critic.model.path", plan.critic_model_path))
    if plan.teacher is not None:
        found.extend(plan.teacher.sources)
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
