"""From a validated config and plan to a running trainer: data, tokenizer, Ray pools, worker groups, the loop."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from transformers import AutoTokenizer

from shardrl.algos import make_kl_controller
from shardrl.controller import ResourcePool, Role, WorkerGroup, init_ray
from shardrl.data import builtin_task
from shardrl.data.chat import pad_id
from shardrl.data.rl_dataset import PromptLoader, RLDataset
from shardrl.rewards.registry import default_compute_score, load_custom_reward
from shardrl.trainer.config import PPOConfig
from shardrl.trainer.fully_async import FullyAsyncTrainer
from shardrl.trainer.one_step_off import OneStepOffTrainer
from shardrl.trainer.plan import Plan
from shardrl.trainer.plots import write_plots
from shardrl.trainer.ppo import PPOTrainer, Workers
from shardrl.trainer.tracking import Tracker
from shardrl.workers.detached import DetachedActorWorker, RolloutWorker
from shardrl.workers.hybrid import ActorRolloutRefWorker, CriticWorker

TRAINERS = {"sync": PPOTrainer, "one_step_off": OneStepOffTrainer, "fully_async": FullyAsyncTrainer}


@dataclasses.dataclass(frozen=True)
class RunPaths:
    run_dir: Path
    model: str
    tokenizer: str
    train_files: list[str]
    val_files: list[str] | None


def resolve_paths(config: PPOConfig) -> RunPaths:
    """The user's model and data, or (null paths) the built-in task made under the run directory."""
    run_dir = Path(config.trainer.default_local_dir)
    model, data = config.actor_rollout_ref.model, config.data
    builtin = None
    if model.path is None or data.train_files is None:
        builtin = builtin_task.prepare(run_dir / "builtin_task", seed=config.trainer.seed)
    model_path = model.path or builtin["model"]
    tokenizer = model.tokenizer or (data.tokenizer if data.tokenizer else model_path)
    train = _as_list(data.train_files) if data.train_files is not None else [builtin["train_files"]]
    if data.val_files is not None:
        val = _as_list(data.val_files)
    else:
        val = [builtin["val_files"]] if data.train_files is None else None
    return RunPaths(run_dir, model_path, tokenizer, train, val)


def _as_list(files: str | list[str]) -> list[str]:
    return [files] if isinstance(files, str) else list(files)


def train(config: PPOConfig, plan: Plan) -> None:
    paths = resolve_paths(config)
    data, trainer = config.data, config.trainer
    tokenizer = AutoTokenizer.from_pretrained(paths.tokenizer)

    def dataset(files: list[str], max_samples: int) -> RLDataset:
        return RLDataset(files, tokenizer, data.max_prompt_length, data.truncation, data.filter_overlong_prompts,
                         data.prompt_key, max_samples)

    # A loader batch is a generation round: train_batch_size prompts, unless dynamic sampling asks for other rounds.
    loader = PromptLoader(dataset(paths.train_files, data.train_max_samples), data.gen_batch_size, data.shuffle,
                          data.seed)
    total_steps = training_steps(config, plan, loader)
    val_prompts = None
    if paths.val_files:
        val = dataset(paths.val_files, data.val_max_samples)
        val_prompts = val.collate(list(range(min(len(val), data.val_batch_size or len(val)))))
    custom = config.custom_reward_function
    score_fn = load_custom_reward(custom.path, custom.name) if custom.path else default_compute_score
    algo = config.algorithm
    kl_ctrl = (make_kl_controller(algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl,
                                  algo.kl_ctrl.horizon) if algo.use_kl_in_reward else None)

    init_ray(**config.ray_kwargs.ray_init)
    group, workers = start_workers(config, plan, paths.model, total_steps, pad_id(tokenizer))
    tracker = Tracker(list(trainer.logger), paths.run_dir, trainer.project_name, trainer.experiment_name,
                      dataclasses.asdict(config))
    ppo = TRAINERS[config.mode](config, workers, loader, val_prompts, tokenizer, score_fn, tracker, kl_ctrl,
                                total_steps)
    try:
        ppo.fit()
        workers.actor.save_hf(str(paths.run_dir / "hf_export"))
    finally:
        tracker.close()
        write_plots(paths.run_dir, ppo.timeline)
        group.shutdown()


def training_steps(config: PPOConfig, plan: Plan, loader: PromptLoader) -> int:
    """trainer.total_training_steps, else the data's prompts (total_epochs over the loader; fully async:
    rollout.total_rollout_steps samples when set) in steps of `plan.step_prompts` prompts."""
    if config.trainer.total_training_steps:
        return config.trainer.total_training_steps
    prompts = len(loader) * loader.batch_size * config.trainer.total_epochs
    if config.rollout is not None and config.rollout.total_rollout_steps:
        prompts = config.rollout.total_rollout_steps // plan.samples_per_prompt
    return max(1, prompts // plan.step_prompts)


def start_workers(config: PPOConfig, plan: Plan, model_path: str, total_steps: int,
                  pad_token_id: int) -> tuple[WorkerGroup, Workers]:
    """One worker group, one torch.distributed world: the trainer pool's ranks, then (detached placement) the
    rollout pool's. Colocated, the actor's ranks also host the rollout engine (hybrid engine)."""
    trainer = config.trainer
    pools = [ResourcePool("trainer", trainer.nnodes, trainer.n_gpus_per_node, plan.device)]
    worker_args = dict(config=config, plan=plan, model_path=model_path, total_steps=total_steps)
    actor_args = {**worker_args, "pad_token_id": pad_token_id}
    on_trainer = dict(ranks=plan.trainer_ranks)
    if plan.placement == "colocated":
        roles = [Role("actor", ActorRolloutRefWorker, actor_args, plan.roles["actor"].spec,
                      {"rollout": plan.roles["rollout"].spec}, **on_trainer)]
    else:
        pools.append(ResourcePool("rollout", config.rollout.nnodes, config.rollout.n_gpus_per_node, plan.device))
        rollout_args = dict(config=config, plan=plan, model_path=model_path, pad_token_id=pad_token_id)
        roles = [Role("actor", DetachedActorWorker, actor_args, plan.roles["actor"].spec, **on_trainer),
                 Role("rollout", RolloutWorker, rollout_args, plan.roles["rollout"].spec, ranks=plan.rollout_ranks)]
    if config.use_critic:
        roles.append(Role("critic", CriticWorker, worker_args, plan.roles["critic"].spec, **on_trainer))
    group = WorkerGroup(pools, roles)
    workers = Workers(group.role("actor"), group.role("critic") if config.use_critic else None,
                      group.role("rollout") if plan.placement == "detached" else None)
    return group, workers
