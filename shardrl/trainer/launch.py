"""From a validated config and plan to a running trainer: data, tokenizer, Ray pools, worker groups, the loop."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Collection
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shardrl.agents.agent_host import AgentHostError
from shardrl.agents.driver import AgentSettings, agent_host
from shardrl.agents.loop import AGENT_LOOPS
from shardrl.agents.function_tools import FunctionToolError, check_unique_names, function_tool_schemas
from shardrl.agents.registry import interaction_names_of, tool_schemas_of
from shardrl.algos import make_kl_controller
from shardrl.algos.distillation import DistillationSettings
from shardrl.controller.cluster import init_ray
from shardrl.controller.group import Role, WorkerGroup
from shardrl.controller.pool import ResourcePool
from shardrl.data import builtin_task
from shardrl.data.chat import pad_id
from shardrl.data.rl_dataset import DatasetError, PromptLoader, RLDataset
from shardrl.errors import first_line
from shardrl.job.errors import ConfigError
from shardrl.job.options import RewardOptions
from shardrl.job.plan import JobPlan
from shardrl.rewards.guarded import GuardedScoreFn
from shardrl.rewards.http_reward import HttpRewardClient
from shardrl.rewards.outcomes import RewardFunctionError
from shardrl.models.checkpoint import find_latest
from shardrl.models.config import ModelConfig
from shardrl.rewards.registry import builtin_sources, default_compute_score, has_scorer
from shardrl.trainer.colocated_async import ColocatedAsyncTrainer
from shardrl.trainer.fully_async import FullyAsyncTrainer
from shardrl.trainer.one_step_off import OneStepOffTrainer
from shardrl.trainer.ppo import PPOTrainer, Workers
from shardrl.trainer.stop_signals import sigterm_stops_like_ctrl_c
from shardrl.trainer.run_dir import start_run, summary
from shardrl.trainer.tracking import Tracker
from shardrl.workers.critic import CriticWorker
from shardrl.workers.judge import JudgeWorker
from shardrl.workers.reward_model import RewardModelWorker, check_reward_model
from shardrl.workers.teacher import TeacherWorker
from shardrl.workers.detached import DetachedActorWorker
from shardrl.workers.hybrid import ActorRolloutRefWorker
from shardrl.workers.rollout import RolloutWorker

TRAINERS = {"sync": PPOTrainer, "one_step_off": OneStepOffTrainer, "fully_async": FullyAsyncTrainer,
            "colocate_async": ColocatedAsyncTrainer}


@dataclasses.dataclass(frozen=True)
class RunPaths:
    run_dir: Path
    model: str
    critic_model: str
    tokenizer: str
    train_files: list[str]
    val_files: list[str] | None
    tool_config: str | None = None  # multi-turn: the tools prompts are rendered with and agents call


def resolve_paths(plan: JobPlan) -> RunPaths:
    """The user's model and data, or (null paths) the built-in task made under the run directory."""
    run_dir, data, agent = Path(plan.loop.run_dir), plan.data, plan.rollout.agent
    builtin = None
    if plan.model_path is None or data.train_files is None:
        multi_turn = agent is not None  # the multi-turn variant: digit lookup through a tool
        builtin = builtin_task.prepare(run_dir / ("builtin_task_multi_turn" if multi_turn else "builtin_task"),
                                       seed=plan.loop.seed, multi_turn=multi_turn)
    model_path = plan.model_path or builtin["model"]
    tokenizer = data.tokenizer or model_path
    train = data.train_files if data.train_files is not None else [builtin["train_files"]]
    if data.val_files is not None:
        val = data.val_files
    else:
        val = [builtin["val_files"]] if data.train_files is None else None
    tool_config = None if agent is None else agent.tool_config_path or (builtin or {}).get("tool_config")
    return RunPaths(run_dir, model_path, plan.critic_model_path or model_path, tokenizer, train, val, tool_config)


def with_agent_paths(plan: JobPlan, paths: RunPaths) -> JobPlan:
    """The plan with its agent settings' tokenizer and tool config resolved (known only at launch), and the data's
    chat-template arguments, which the environment's turns are rendered with as the prompts are."""
    agent = plan.rollout.agent
    if agent is None:
        return plan
    agent = dataclasses.replace(agent, tokenizer_path=paths.tokenizer, tool_config_path=paths.tool_config,
                                template_kwargs=tuple(sorted(plan.data.apply_chat_template_kwargs.items())))
    return dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, agent=agent))


def validation_prompts(dataset: RLDataset, batch_size: int | None, shuffle: bool, seed: int):
    """The validation batch: the first `batch_size` prompts (all when null), in file order or (validation_shuffle)
    in an order drawn from the data seed."""
    rows = list(range(len(dataset)))
    if shuffle:
        rows = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    return dataset.collate(rows[:min(len(dataset), batch_size or len(dataset))])


def train(plan: JobPlan) -> None:
    started = time.perf_counter()
    paths = resolve_paths(plan)
    plan = with_agent_paths(plan, paths)
    data = plan.data
    tokenizer_key = "data.tokenizer" if data.tokenizer else "actor_rollout_ref.model.path"
    tokenizer = load_tokenizer(paths.tokenizer, tokenizer_key, data.trust_remote_code)
    tools = agent_tool_schemas(paths.tool_config, None if plan.rollout.agent is None else
                               plan.rollout.agent.function_tool_path)
    if plan.teacher is not None:
        for key, path in plan.teacher.sources:
            check_teacher_vocabulary(key, path, tokenizer, data.trust_remote_code)
        check_distillation_topk(plan.actor.distillation, len(tokenizer))
    plan = with_reward_model_tokenizer(plan, tokenizer)

    route = plan.teacher.route_field if plan.teacher is not None else None

    def dataset(files: list[str], max_samples: int, key: str) -> RLDataset:
        try:
            return RLDataset(files, tokenizer, data.max_prompt_length, data.truncation, data.filter_overlong_prompts,
                             data.prompt_key, max_samples, chat_template_kwargs=data.apply_chat_template_kwargs,
                             data_source_key=plan.reward.data_source_key, tools=tools,
                             render_workers=data.render_workers, media_keys=data.media_keys,
                             carried_columns=(route,) if route else ())
        except DatasetError as err:
            raise ConfigError(key, str(err)) from None

    # A loader batch is a generation round: train_batch_size prompts, unless dynamic sampling asks for other rounds.
    loader = PromptLoader(dataset(paths.train_files, data.train_max_samples, "data.train_files"),
                          data.gen_batch_size, data.shuffle, data.seed)
    plan = plan.with_total_steps(training_steps(plan, loader))
    val_prompts, val_data = None, None
    if paths.val_files:
        val_data = dataset(paths.val_files, data.val_max_samples, "data.val_files")
        val_prompts = validation_prompts(val_data, data.val_batch_size, data.validation_shuffle, data.seed)
    if plan.loop.val_only and val_prompts is None:
        raise ConfigError("trainer.val_only", "there is no validation data to run; set data.val_files")
    datasets = [d for d in (loader.dataset, val_data) if d is not None]
    if route:
        check_teacher_routes(loader.dataset, route, plan.teacher.by_key)
    check_prompt_ids_fit(datasets, paths.model, tokenizer_key)
    agents_score = plan.rollout.agent is not None and bool(plan.rollout.agent.agent_loop_config_path)
    if rule_scorer_scores(plan.reward, plan.reward_model is not None) and not agents_score:
        check_data_sources(datasets, plan.reward.data_source_key)
    if plan.rollout.agent is not None:
        check_agent_rows(plan.rollout.agent, datasets)
        check_agent_functions(plan.rollout.agent)
    kl = plan.algorithm.kl_in_reward
    kl_ctrl = make_kl_controller(kl.controller, kl.coef, kl.target_kl, kl.horizon) if kl is not None else None
    with contextlib.ExitStack() as stack:
        score_fn = reward_scorer(plan.reward, stack)
        announce_user_files(plan, paths)
        start = start_run(paths.run_dir, plan.loop.resume_mode, plan.loop.resume_from_path)
        init_ray(**plan.cluster.ray_init)
        stack.enter_context(sigterm_stops_like_ctrl_c())
        group, workers = start_workers(plan, paths, pad_id(tokenizer))
        tracking = plan.tracking
        tracker = Tracker(tracking.loggers, paths.run_dir, tracking.project, tracking.experiment, tracking.config,
                          resume_step=start.continue_after)
        ppo = TRAINERS[plan.mode](plan, workers, loader, val_prompts, tokenizer, score_fn, tracker, kl_ctrl)
        stopped: KeyboardInterrupt | None = None
        try:
            ppo.fit(start.checkpoint)
            if not plan.loop.val_only:  # nothing was trained to export
                ppo.save_hf(paths.run_dir / "hf_export")
        except KeyboardInterrupt as stop:  # Ctrl-C, SIGINT or SIGTERM (stop_signals.py): the logged steps stay
            stopped = stop
        finally:
            tracker.close()
            group.shutdown()
        print(summary(paths.run_dir, ppo.global_step, time.perf_counter() - started, tracker.latest,
                      find_latest(paths.run_dir), interrupted=stopped is not None), flush=True)
        if stopped is not None:
            raise stopped


def announce_user_files(plan: JobPlan, paths: RunPaths) -> None:
    """One line per file of the user's that the run loaded (reward function, tools, interactions, agent loops), so
    a log shows which code it trained with."""
    reward, agent = plan.reward, plan.rollout.agent
    if reward.custom_path:
        print(f"loaded reward function {Path(reward.custom_path).expanduser().resolve()}:{reward.custom_name}")
    if agent is None:
        return
    for what, file in (("tool config", agent.tool_config_path), ("function tools", agent.function_tool_path),
                       ("interaction config", agent.interaction_config_path),
                       ("agent loop config", agent.agent_loop_config_path)):
        if file:
            print(f"loaded {what} {Path(file).expanduser().resolve()}")


def reward_scorer(reward: RewardOptions, stack: contextlib.ExitStack):
    """What scores the samples: the user's reward function (guarded, closed with `stack`), the user's reward
    service (`custom_reward_function.url`), or the built-in scorers by data source."""
    if reward.custom_path:
        return stack.enter_context(custom_score_fn(reward))
    if reward.server_url:
        return HttpRewardClient(reward.server_url, max_concurrency=reward.server_concurrency,
                                timeout=reward.custom_timeout, retries=reward.server_retries,
                                backoff=reward.server_backoff, on_error=reward.custom_on_error)
    return default_compute_score


def custom_score_fn(reward: RewardOptions) -> GuardedScoreFn:
    """The user's reward function in processes of its own, per-sample timeout and failure policy
    (`custom_reward_function.*`); loaded there now, before workers start, never imported into the trainer."""
    try:
        return GuardedScoreFn(reward.custom_path, reward.custom_name, num_workers=reward.custom_workers,
                              timeout=reward.custom_timeout, on_error=reward.custom_on_error)
    except RewardFunctionError as err:
        raise ConfigError("custom_reward_function.path", str(err)) from None


TOOL_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
FUNCTION_TOOL_KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"


def agent_tool_schemas(tool_config: str | None, function_tools: str | None = None) -> list[dict] | None:
    """The tools' schemas prompts are rendered with (None: no tools): the tool config's, then the function-tool
    file's (read in a process of its own); a bad file or a name twice is a ConfigError."""
    if tool_config is None and function_tools is None:
        return None
    try:
        schemas = tool_schemas_of(tool_config) if tool_config is not None else []
    except ValueError as err:
        raise ConfigError(TOOL_CONFIG_KEY, str(err)) from None
    if function_tools is not None:
        try:
            schemas += function_tool_schemas(function_tools)
            check_unique_names([schema["function"]["name"] for schema in schemas], function_tools)
        except FunctionToolError as err:
            raise ConfigError(FUNCTION_TOOL_KEY, str(err)) from None
    return schemas


def check_agent_functions(agent: AgentSettings) -> None:
    """Every agent function of `agent.agent_loop_config_path` loads, in an agent process as in training (it is never
    imported here): a bad path or name is a ConfigError before workers start."""
    if not agent.agent_loop_config_path:
        return
    file = Path(agent.agent_loop_config_path).expanduser()
    for index, entry in enumerate(OmegaConf.to_container(OmegaConf.load(file))):
        if isinstance(entry, dict) and "function" in entry:
            host = agent_host(str(entry["function"]), agent.endpoint, file.parent, num_processes=1)
            try:
                host.start()
            except AgentHostError as err:
                raise ConfigError("actor_rollout_ref.rollout.agent.agent_loop_config_path",
                                  f"{file}: [{index}]: {err}") from None
            finally:
                host.close()


def check_agent_rows(agent: AgentSettings, datasets: list[RLDataset]) -> None:
    """Every row's agent loop exists, and with interactions configured every tool-agent row names one of them:
    found here, before workers start, rather than as a failed trajectory. Raises ConfigError."""
    loops = set(AGENT_LOOPS)
    if agent.agent_loop_config_path:
        loops |= {entry.get("name") for entry in OmegaConf.to_container(OmegaConf.load(agent.agent_loop_config_path))
                  if isinstance(entry, dict)}
    if agent.default_agent_loop not in loops:
        raise ConfigError("actor_rollout_ref.rollout.agent.default_agent_loop",
                          f"{agent.default_agent_loop!r} is no agent loop; there are {sorted(loops)}")
    names: list[str] = []
    if agent.interaction_config_path:
        try:
            names = interaction_names_of(agent.interaction_config_path)
        except ValueError as err:
            raise ConfigError("actor_rollout_ref.rollout.multi_turn.interaction_config_path", str(err)) from None
    for data in datasets:
        for number, row in enumerate(data.rows):
            name = row.get("agent_name") or agent.default_agent_loop
            if name not in loops:
                raise ConfigError("data agent_name", f"row {number} names agent loop {name!r}; there are "
                                                     f"{sorted(loops)} (register one, or agent.agent_loop_config_path)")
            kwargs = (row.get("extra_info") or {}).get("interaction_kwargs") or {}
            if names and name == "tool_agent" and kwargs.get("name") not in names:
                raise ConfigError("data extra_info.interaction_kwargs.name",
                                  f"row {number} has {kwargs.get('name')!r}; the interaction config has {names}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str, key: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The tokenizer of local directory `path` (`key` names the setting); a ConfigError when there is none."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(key, f"{path} is not a local tokenizer directory; pass the model's directory (or "
                               f"data.tokenizer=<a directory with the tokenizer files>)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json alone
        raise ConfigError(key, f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); set "
                               f"data.tokenizer to the directory that has them")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, or the tokenizer code's own errors
        raise ConfigError(key, f"{path}: no tokenizer could be loaded ({first_line(err)})") from None


def check_prompt_ids_fit(datasets: list[RLDataset], model_path: str, tokenizer_key: str) -> None:
    """Every prompt token id is a row of the model's embedding: a tokenizer of another, larger vocabulary would
    otherwise end as an index error inside a worker's forward. Raises ConfigError."""
    vocab = ModelConfig.from_pretrained(model_path).vocab_size
    for dataset in datasets:
        largest = max((max(ids) for ids in dataset.prompt_ids if ids), default=-1)
        if largest >= vocab:
            row = next(i for i, ids in enumerate(dataset.prompt_ids) if ids and max(ids) == largest)
            where = f"prompt {row} of {', '.join(dataset.files)}"
            raise ConfigError(tokenizer_key, f"{where} has token id {largest}, but the model ({model_path}) has "
                                             f"vocab_size {vocab}; use the model's own tokenizer")


def rule_scorer_scores(reward: RewardOptions, has_reward_model: bool) -> bool:
    """Whether samples go through the built-in scorers (no reward function or service of the user's, and no
    reward model or judge that replaces the reward function)."""
    if reward.custom_path or reward.server_url:
        return False
    if has_reward_model and reward.reward_model.combine == "replace":
        return False
    return reward.judge is None or reward.judge.combine != "replace"


def check_data_sources(datasets: list[RLDataset], data_source_key: str) -> None:
    """Every row's data source has a built-in scorer (else scoring would fail at the first step; not asked when the
    user's agent functions may return the rewards themselves). Raises ConfigError naming the first such row."""
    for dataset in datasets:
        for number, row in enumerate(dataset.rows):
            if not has_scorer(row[data_source_key]):
                raise ConfigError(f"data {data_source_key}", f"prompt {number} of {', '.join(dataset.files)} has "
                                                             f"{data_source_key}={row[data_source_key]!r}, which "
                                                             f"no built-in scorer handles ({builtin_sources()}); "
                                                             f"set custom_reward_function.path/name")


def check_teacher_vocabulary(key: str, teacher_path: str, student, trust_remote_code: bool) -> None:
    """The teacher (its directory at config `key`) scores the student's token ids, so both must mean the same tokens:
    the teacher's tokenizer must have the student's vocabulary (its model may pad its embedding to another size).
    Raises ConfigError."""
    try:
        teacher = AutoTokenizer.from_pretrained(teacher_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ConfigError(key, f"{teacher_path}: no tokenizer could be loaded ({str(err).splitlines()[0]})") from None
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
        raise ConfigError(key, f"the teacher's vocabulary ({len(theirs)} tokens) differs from the student's "
                               f"({len(mine)}), e.g. {differ}; distillation needs the student's tokenizer")


def check_teacher_routes(dataset: RLDataset, field: str, keys: Collection[str]) -> None:
    """Every training prompt's `field` names one of the teachers (their `keys`), before workers start; a prompt
    no teacher scores would stop the run at its step."""
    for number, row in enumerate(dataset.rows):
        if row.get(field) not in keys:
            raise ConfigError("distillation.teacher_key", f"data.train_files row {number} has {field}="
                              f"{row.get(field)!r}, which no teacher's key names (the teachers' keys: "
                              f"{sorted(keys)}); add a teacher for it or fix the row")


def check_distillation_topk(distillation: DistillationSettings, vocab_size: int) -> None:
    """forward_kl_topk's k is at most the vocabulary (the tokenizer's, which the teacher shares)."""
    if distillation.uses_topk and distillation.topk > vocab_size:
        raise ConfigError("distillation.distillation_loss.topk", f"{distillation.topk} exceeds the vocabulary's "
                                                                 f"{vocab_size} tokens; set at most {vocab_size}")


def training_steps(plan: JobPlan, loader: PromptLoader) -> int:
    """trainer.total_training_steps, else the data's prompts (total_epochs over the loader; fully async:
    rollout.total_rollout_steps samples when set) in steps of `plan.step_prompts` prompts."""
    loop = plan.loop
    if loop.total_training_steps:
        return loop.total_training_steps
    prompts = len(loader) * loader.batch_size * loop.total_epochs
    if loop.total_rollout_steps:
        prompts = loop.total_rollout_steps // plan.samples_per_prompt
    return max(1, prompts // plan.step_prompts)


def start_workers(plan: JobPlan, paths: RunPaths, pad_token_id: int) -> tuple[WorkerGroup, Workers]:
    """One worker group, one torch.distributed world: the trainer pool's ranks, then (detached placement) the
    rollout pool's, then (`reward_model.enable_resource_pool`) the reward model's, then (`distillation.n_gpus_per_node`)
    the teachers'. Colocated, the actor's ranks also host the rollout engine (hybrid engine); the teachers without a
    pool live on the trainer pool's ranks."""
    cluster = plan.cluster
    whole = dict(whole_cpu_cores=cluster.whole_cpu_cores)
    pools = [ResourcePool("trainer", cluster.trainer_nodes, cluster.trainer_gpus_per_node, plan.device, **whole)]
    on_trainer = dict(ranks=plan.trainer_ranks)
    actor_spec = plan.roles["actor"].spec
    if plan.placement == "colocated":
        actor = Role("actor", ActorRolloutRefWorker,
                     dict(actor=plan.actor, ref=plan.ref, rollout=plan.rollout, model_path=paths.model,
                          pad_token_id=pad_token_id), actor_spec, {"rollout": plan.rollout.spec},
                     **on_trainer)
        roles = [actor]
    else:
        pools.append(ResourcePool("rollout", cluster.rollout_nodes, cluster.rollout_gpus_per_node, plan.device,
                                  **whole))
        actor = Role("actor", DetachedActorWorker,
                     dict(actor=plan.actor, ref=plan.ref, weight_sync=plan.rollout.weight_sync,
                          model_path=paths.model), actor_spec, **on_trainer)
        rollout = Role("rollout", RolloutWorker, dict(options=plan.rollout, model_path=paths.model,
                                                      pad_token_id=pad_token_id), plan.rollout.spec,
                       ranks=plan.rollout_ranks)
        roles = [actor, rollout]
    if plan.critic is not None:
        roles.append(Role("critic", CriticWorker, dict(options=plan.critic, model_path=paths.critic_model),
                          plan.critic.model.spec, **on_trainer))
    if plan.reward_model is not None:
        if cluster.reward_model_nodes is not None:  # a pool of its own, ranks after the others' (plan_job)
            pools.append(ResourcePool("reward_model", cluster.reward_model_nodes, cluster.reward_model_gpus_per_node,
                                      plan.device, **whole))
        roles.append(Role("reward_model", RewardModelWorker, dict(options=plan.reward_model,
                                                                  model_path=plan.reward_model_path),
                          plan.reward_model.model.spec, ranks=plan.reward_model.model.ranks))
    if plan.teacher is not None:
        if cluster.teacher_nodes is not None:  # the teachers' own pool, ranks after all the others' (plan_job)
            pools.append(ResourcePool("teacher", cluster.teacher_nodes, cluster.teacher_gpus_per_node, plan.device,
                                      **whole))
        roles.extend(Role(f"teacher:{key}", TeacherWorker, dict(options=teacher), teacher.model.spec,
                          ranks=teacher.model.ranks) for key, teacher in plan.teacher.by_key.items())
    if plan.judge is not None:
        roles.append(Role("judge", JudgeWorker, dict(options=plan.judge, policy_tokenizer=paths.tokenizer),
                          plan.judge.spec, **on_trainer))
    group = WorkerGroup(pools, roles, collective_timeout=cluster.collective_timeout)
    print(f"placement: {group.placement()}", flush=True)
    workers = Workers(group.role("actor"), group.role("critic") if plan.critic is not None else None,
                      group.role("rollout") if plan.placement == "detached" else None,
                      group.role("reward_model") if plan.reward_model is not None else None,
                      group.role("judge") if plan.judge is not None else None,
                      {key: group.role(f"teacher:{key}") for key in plan.teacher.by_key} if plan.teacher else {})
    return group, workers


def with_reward_model_tokenizer(plan: JobPlan, policy: PreTrainedTokenizerBase) -> JobPlan:
    """The plan whose reward model re-renders samples only when its tokenizer is not the policy's (another
    vocabulary or chat template; verl's `reward_model.model.input_tokenizer` then decodes them), and scores the
    policy's own token ids otherwise. Its checkpoint is checked here, before workers start."""
    rm = plan.reward_model
    if rm is None:
        return plan
    key = "reward_model.model.path"
    try:
        check_reward_model(rm.model, plan.reward_model_path)
        own = AutoTokenizer.from_pretrained(plan.reward_model_path)
    except (OSError, ValueError) as err:
        raise ConfigError(key, str(err).splitlines()[0]) from None
    same = own.get_vocab() == policy.get_vocab() and own.chat_template == policy.chat_template
    source = rm.input_tokenizer or policy.name_or_path
    return dataclasses.replace(plan, reward_model=dataclasses.replace(rm, input_tokenizer=None if same else source))
