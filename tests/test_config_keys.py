"""Every config key is consumed or refused (issue "The house"): each leaf of the schema is either read by exactly one
function of the planner (`shardrl/job/compile.py`, `batches.py`, `plan.py`) while it compiles the packaged configs, or
is in `shardrl/job/compat.py`, whose refusals fire in the dry run with a one-line error naming the key.

Reads are recorded by watching attribute access on the config's dataclasses during `plan_job`, so a consumer that is
deleted (or a key that nobody reads) fails here, whatever the key's name."""

import dataclasses
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from shardrl.job import schema
from shardrl.job.build import field_paths
from shardrl.job.compat import ACCEPTED, REFUSED
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.job.schema import PPOConfig

JOB = Path(schema.__file__).parent
CONSUMER_FILES = {str(JOB / name) for name in ("compile.py", "batches.py", "plan.py")}
NOT_CONSUMERS = {"format_plan"}  # the dry run's printout reads keys to show them
PASS_THROUGH = {str(JOB / "schema.py"), __file__}  # properties, `at` and this recorder read for their caller

# Configs that together take every conditional branch of the planner (a critic, a reference policy, KL in reward,
# dynamic sampling, overlong shaping, a reward model on its own pool or not, a judge, both async modes, both
# kinds of distillation loss, one teacher and several, on the trainer pool or their own, the two covariance-selecting policy losses).
VARIANTS = [
    ("ppo_trainer", ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
                     "algorithm.use_kl_in_reward=true", "reward_model.overlong_buffer.enable=true",
                     "reward_model.overlong_buffer.len=1"]),
    ("ppo_trainer", ["algorithm.filter_groups.enable=true", "distillation.enabled=true",
                     "distillation.teacher_model.model_path=/a/teacher", "reward_model.enable=true",
                     "reward_model.model.path=/a/rm", "reward_model.enable_resource_pool=true",
                     "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1"]),
    ("ppo_trainer", ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
                     "critic.use_dynamic_bsz=true", "distillation.enabled=true",
                     "distillation.teacher_model.model_path=/a/teacher",
                     "distillation.distillation_loss.loss_mode=forward_kl_topk", "reward_model.enable=true",
                     "reward_model.model.path=/a/rm", "reward_model.use_dynamic_bsz=true"]),
    ("ppo_trainer", ["distillation.enabled=true", "+distillation.teacher_models.math.key=math",
                     "+distillation.teacher_models.math.model_path=/a/t1", "+distillation.teacher_models.code.key=code",
                     "+distillation.teacher_models.code.model_path=/a/t2"]),
    ("ppo_trainer", ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=/a/t",
                     "distillation.nnodes=1", "distillation.n_gpus_per_node=2"]),
    ("ppo_trainer", ["reward_model.judge.enable=true", "reward_model.judge.model_path=/a/judge",
                     "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "trainer.v1.trainer_mode=colocate_async"]),
    ("one_step_off_ppo_trainer", ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.multi_turn.enable=true"]),
    ("fully_async_ppo_trainer", ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
                                 "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov"]),
    ("ppo_trainer", ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.exclude_modules=[down_proj]",
                     "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.adv_estimator=gae",
                     "critic.model.lora_rank=8"]),
]


def schema_classes() -> list[type]:
    return [c for c in vars(schema).values() if isinstance(c, type) and dataclasses.is_dataclass(c)]


def group_paths(config: PPOConfig) -> dict[int, str]:
    """id of every group object of `config` -> its dotted path ("" for the root)."""
    paths = {}

    def walk(node, prefix):
        paths[id(node)] = prefix
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}.{f.name}" if prefix else f.name)

    walk(config, "")
    return paths


def record_reads(config: PPOConfig) -> dict[str, set[str]]:
    """leaf key -> the planner functions that read it while `plan_job(config)` runs."""
    paths, reads = group_paths(config), defaultdict(set)
    leaves = set(field_paths(PPOConfig))
    originals = {cls: cls.__getattribute__ for cls in schema_classes()}

    def watch(original):
        def getattribute(self, name):
            value = original(self, name)
            prefix = paths.get(id(self))
            key = f"{prefix}.{name}" if prefix else name
            if prefix is not None and key in leaves:
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename in PASS_THROUGH:
                    frame = frame.f_back
                if frame is not None and frame.f_code.co_filename in CONSUMER_FILES:
                    if frame.f_code.co_name not in NOT_CONSUMERS:
                        reads[key].add(frame.f_code.co_qualname)
            return value
        return getattribute

    try:
        for cls, original in originals.items():
            cls.__getattribute__ = watch(original)
        plan_job(config)
    finally:
        for cls, original in originals.items():
            cls.__getattribute__ = original
    return reads


@pytest.fixture(scope="module")
def consumers() -> dict[str, set[str]]:
    found = defaultdict(set)
    for name, overrides in VARIANTS:
        for key, readers in record_reads(compose(name, overrides)).items():
            found[key] |= readers
    return found


COMPAT = {entry.key for entry in (*REFUSED, *ACCEPTED)}
# Keys refused in some configs only (`Refused.applies`) have their effect in the others, so they are consumed too.
EVERYWHERE = {entry.key for entry in REFUSED if entry.applies is None} | {entry.key for entry in ACCEPTED}


def test_compat_list_names_schema_keys_once():
    keys = [entry.key for entry in (*REFUSED, *ACCEPTED)]
    assert len(keys) == len(set(keys))
    assert set(keys) - set(field_paths(PPOConfig)) == set()


def test_every_key_is_consumed_or_in_the_compat_list(consumers):
    missing = sorted(set(field_paths(PPOConfig)) - set(consumers) - COMPAT)
    assert not missing, f"keys with no consumer in the planner and no compat entry: {missing}"


def test_every_consumed_key_has_exactly_one_reader(consumers):
    """One place turns a key into behaviour: a value two functions read can be read two ways."""
    many = {key: sorted(readers) for key, readers in consumers.items() if len(readers) > 1}
    assert not many, f"keys read by more than one planner function: {many}"


def test_compat_keys_are_not_also_consumed(consumers):
    assert sorted(EVERYWHERE & set(consumers)) == []


@pytest.mark.parametrize("entry", REFUSED, ids=[e.key for e in REFUSED])
def test_refused_values_fail_in_the_dry_run_naming_the_key(entry, tmp_path):
    name = "one_step_off_ppo_trainer" if entry.key.endswith("free_cache_engine") else "ppo_trainer"
    config = compose(name)
    plan_job(config)  # the default is supported
    value = entry.example
    assert not entry.supported(value)
    override = f"{entry.key}={value}" if not isinstance(value, dict) else f"+{entry.key}.vllm.swap_space=4"
    with pytest.raises(ConfigError) as err:
        plan_job(compose(name, [override]))
    assert err.value.key == entry.key
    assert "not supported by shardrl" in str(err.value) and "\n" not in str(err.value)


def test_a_refusal_is_one_line_with_exit_code_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "shardrl.trainer.main_ppo", "trainer.dry_run=true",
                           "actor_rollout_ref.rollout.load_format=safetensors"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: actor_rollout_ref.rollout.load_format: 'safetensors' is not supported by shardrl (the rollout engine "
        "always receives the actor's weights by weight sync before it generates; nothing is loaded from disk; "
        "set dummy)"]
