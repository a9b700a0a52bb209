"""The trainer's CLI with a user's verl-format tool config (a tool class in the user's own file) and an interaction
config, end to end on the built-in multi-turn task's model: tools run, the interaction answers turns without calls,
both show in the metrics, and the timeline and metrics carry the agent runner's stats."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from async_jobs import run_job
from shardrl.data import builtin_task

EXAMPLE_LOOPS = Path(__file__).resolve().parents[1] / "examples" / "openai_agent" / "agent_loops.yaml"

USER_TOOL = '''
from typing import Any, Optional
from uuid import uuid4

from shardrl.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse


class SecretTool(BaseTool):
    """A verl-style tool with instance state; writes every call to a log file the test reads."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = kwargs["create_kwargs"]["value"]
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        with open(self.config["log"], "a") as log:
            log.write(self._instance_dict[instance_id] + "\\n")
        return ToolResponse(text=self._instance_dict[instance_id]), 0.0, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''
USER_INTERACTION = '''
from shardrl.agents.interactions import BaseInteraction


class Nudge(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        return len(messages) > 4, "1", 0.5, {}
'''


def test_user_tool_and_interaction_files_run_in_a_training_job(tmp_path):
    task = builtin_task.prepare(tmp_path / "task", multi_turn=True)
    (tmp_path / "my_tools.py").write_text(USER_TOOL)
    (tmp_path / "my_interactions.py").write_text(USER_INTERACTION)
    tool_yaml = builtin_task.LOOKUP_TOOL_CONFIG.replace("shardrl.agents.lookup_tool.LookupTool", "my_tools.py:SecretTool")
    tool_yaml = tool_yaml.replace("      type: native\n", f"      type: native\n      log: {tmp_path / 'calls.log'}\n")
    (tmp_path / "tools.yaml").write_text(tool_yaml)
    (tmp_path / "interactions.yaml").write_text(
        "interaction:\n  - name: nudge\n    class_name: my_interactions.py:Nudge\n    config: {}\n")
    rows = builtin_task.make_rows(64, seed=3, multi_turn=True)
    for row in rows:
        row["extra_info"]["interaction_kwargs"] = {"name": "nudge"}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={tmp_path / 'run'}",
           "trainer.logger=[file]", f"actor_rollout_ref.model.path={task['model']}",
           f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'train.parquet'}",
           "data.max_response_length=12", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
           "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "actor_rollout_ref.rollout.multi_turn.enable=true",
           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
           f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path / 'interactions.yaml'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for what, name in (("tool config", "tools.yaml"), ("interaction config", "interactions.yaml")):
        assert f"loaded {what} {(tmp_path / name).resolve()}" in done.stdout.splitlines()  # the driver says which
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    calls = (tmp_path / "calls.log").read_text().split()
    assert calls and set(calls) <= set("0123456789")  # the user's tool ran, on its samples' values
    assert sum(m["agent/tool_calls/mean"] for m in metrics) > 0
    assert sum(m["agent/tokens_user/mean"] for m in metrics) > 0  # the interaction answered
    assert all(m["agent/loop_errors/mean"] == 0 for m in metrics)
    assert all("agent/decode_steps_during_tools" in m and "agent/tool_idle_s" in m for m in metrics)


def two_agents_overrides(tmp_path):
    """The trainer's flags (up to the schedule's) on the built-in multi-turn task, 2 ranks: half the rows run the
    built-in tool agent, half the OpenAI-client agent of examples/openai_agent through the endpoint."""
    task = builtin_task.prepare(tmp_path / "task", multi_turn=True)
    rows = builtin_task.make_rows(256, seed=5, multi_turn=True)
    for row in rows[::2]:
        row["agent_name"] = "openai_tool_agent"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    return ["trainer.n_gpus_per_node=2", f"actor_rollout_ref.model.path={task['model']}",
            f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={tmp_path / 'train.parquet'}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={EXAMPLE_LOOPS}",
            "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.multi_turn.enable=true",
            "data.max_response_length=8", "trainer.val_before_train=false"]


def test_fully_async_partial_rollout_runs_multi_turn_within_its_staleness_bound(tmp_path):
    """Trajectories paused by weight syncs (mid turn or between turns) continue under the new weights on two
    rollout replicas; every token of every trained sample stays within the staleness bound. Half the rows run the
    built-in tool agent, half the OpenAI-client agent of examples/openai_agent through each replica's endpoint."""
    metrics, out = run_job(tmp_path, "fully_async_ppo_trainer", *two_agents_overrides(tmp_path),
                           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "rollout.n_gpus_per_node=2",
                           "async_training.partial_rollout=true", "async_training.require_batches=2",
                           "async_training.trigger_parameter_sync_step=2", "async_training.staleness_threshold=0.25",
                           "trainer.total_training_steps=8", "trainer.test_freq=-1")
    assert "fully_async mode: samples may be up to 2 versions old" in out
    assert f"loaded agent loop config {EXAMPLE_LOOPS.resolve()}" in out.splitlines()
    assert len(metrics) == 8
    assert max(m["async/staleness_max"] for m in metrics) <= 2
    # With partial rollout a paused sample may be overtaken and come back past the bound; the trainer then drops it
    # (staleness.py), so how many go depends on timing (0 in most runs, some in others): at most a step's samples
    # (2 batches x 16 prompts x 8), so paused trajectories mostly do come back to train.
    assert metrics[-1]["async/dropped_samples"] <= 2 * 16 * 8, [m["async/dropped_samples"] for m in metrics]
    assert sum(m["agent/tool_calls/mean"] for m in metrics) > 0
    assert all("rollout/decode_steps_during_tools" in m for m in metrics)
    # The endpoint's episodes (their agent processes start after the built-in loop's first trajectories finish).
    endpoint = [m for m in metrics if "agent/endpoint/episodes" in m]
    assert len(endpoint) >= len(metrics) - 2 and all(m["agent/endpoint/failed_episodes"] == 0 for m in endpoint)
    assert max(m["agent/endpoint/requests_per_episode"] for m in endpoint) > 1  # tool results went back


@pytest.mark.slow  # 25 s; the default suite keeps the fully async multi-turn job
def test_colocate_async_continues_multi_turn_trajectories_across_steps(tmp_path):
    """verl 0.9's colocated async trainer on multi-turn rows (built-in tool agent and the OpenAI-client agent) on two
    engine replicas: trajectories stopped by a step (mid turn or between turns) continue under the new weights, and
    every trained token stays within the span rule's bound."""
    metrics, out = run_job(tmp_path, "ppo_trainer", *two_agents_overrides(tmp_path), "data.train_batch_size=16",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.v1.trainer_mode=colocate_async",
                           "trainer.v1.colocate_async.num_warmup_batches=1",
                           "trainer.v1.sampler.max_off_policy_threshold=3", "trainer.total_training_steps=6",
                           "trainer.test_freq=3")
    assert "colocate_async mode: samples may be up to 2 versions old" in out
    trained = [m for m in metrics if "async/staleness_max" in m]
    assert len(trained) == 6 and max(m["async/staleness_max"] for m in trained) <= 2
    assert sum(m["agent/tool_calls/mean"] for m in trained) > 0 and "val-core/reward/mean" in metrics[-1]


def test_rows_naming_unknown_loops_or_interactions_are_refused_before_workers_start(tmp_path):
    task = builtin_task.prepare(tmp_path / "task", multi_turn=True)
    rows = builtin_task.make_rows(16, seed=0, multi_turn=True)
    rows[2]["agent_name"] = "react_agent"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={tmp_path / 'run'}",
           f"actor_rollout_ref.model.path={task['model']}", f"data.train_files={tmp_path / 'bad.parquet'}",
           "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
           "actor_rollout_ref.rollout.multi_turn.enable=true"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "data agent_name: row 2 names agent loop 'react_agent'" in done.stderr
    assert "Traceback" not in done.stderr
    (tmp_path / "i.yaml").write_text("interaction:\n  - class_name: x.py:JudgeInteraction\n")
    rows[2]["agent_name"] = "tool_agent"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    (tmp_path / "loops.yaml").write_text("- name: tool_agent\n  function: no_such_agent.py:run_episode\n")
    done = subprocess.run(cmd + [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "actor_rollout_ref.rollout.agent.agent_loop_config_path:" in done.stderr
    assert "no_such_agent.py" in done.stderr.strip().splitlines()[-1]
    done = subprocess.run(cmd + [f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path / 'i.yaml'}"],
                          capture_output=True, text=True, timeout=300)
    assert "data extra_info.interaction_kwargs.name: row 0 has None; the interaction config has ['judge']" in done.stderr
