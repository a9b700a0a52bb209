"""Multi-turn agent trajectories on the real engine (CPU): token-exact with the Qwen3 tokenizer, environment tokens
masked out of every loss term, slow tools do not stall other trajectories, tool failures become messages, user
tool and interaction classes from verl-format config files run, and a partial rollout (weights updated mid
trajectory) keeps per-token policy versions that never decrease."""

import asyncio
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from shardrl.agents import loop as loop_module
from shardrl.agents import parsers
from shardrl.agents.driver import AgentSettings, build_runner
from shardrl.agents.loop import AgentLoop, AgentSample, Episode, TurnLimits, register
from shardrl.agents.parsers import FunctionCall, ParsedTurn
from shardrl.agents.render import TurnRenderer
from shardrl.agents.trajectory import Source
from shardrl.algos import ClipRange
from shardrl.algos.aggregate import LossScale
from shardrl.algos.policy_loss import actor_loss
from shardrl.data.batch import Batch
from shardrl.data.chat import left_pad
from shardrl.models.tiny import make_tiny_checkpoint
from shardrl.parallel.layout import Layout
from shardrl.rollout.engine import Engine, EngineConfig
from shardrl.rollout.request import RequestOutput, SamplingParams
from shardrl.workers.samples import generate_trajectories

QWEN3 = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "qwen3"
PROMPT_LEN, RESPONSE_LEN = 256, 40
TOOLS_YAML = """tools:
  - class_name: {tool_file}:EchoTool
    config:
      type: native
    tool_schema:
      type: function
      function:
        name: echo
        description: Repeats its text, twice.
        parameters:
          type: object
          properties:
            text:
              type: string
          required: [text]
"""
# A user's tool as a verl user writes it, imports changed to shardrl's.
TOOL_FILE = '''
from typing import Any, Optional
from uuid import uuid4

from shardrl.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse


class EchoTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = kwargs.get("create_kwargs", {}).get("prefix", "")
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        text = parameters.get("text", "")
        if text == "boom":
            raise RuntimeError("the tool broke")
        if text == "slow":
            import asyncio
            await asyncio.sleep(30)
        return ToolResponse(text=self._instance_dict[instance_id] + text * 2), 0.5, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''
INTERACTION_YAML = """interaction:
  - name: judge
    class_name: {file}:CountingJudge
    config: {{}}
"""
INTERACTION_FILE = '''
from shardrl.agents.interactions import BaseInteraction


class CountingJudge(BaseInteraction):
    """Answers twice, then ends the conversation with a score."""

    def __init__(self, config):
        super().__init__(config)
        self.turns = {}

    async def start_interaction(self, instance_id=None, **kwargs):
        instance_id = instance_id or "x"
        self.turns[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self.turns[instance_id] += 1
        done = self.turns[instance_id] > 2
        return done, f"try again {self.turns[instance_id]}", 0.25 * self.turns[instance_id], {}

    async def finalize_interaction(self, instance_id=None, **kwargs):
        self.turns.pop(instance_id, None)
'''


@pytest.fixture(scope="module")
def tokenizer():
    if not QWEN3.is_dir():
        pytest.skip(f"the Qwen3 tokenizer is not at {QWEN3} (../shared/data)")
    return AutoTokenizer.from_pretrained(QWEN3)


@pytest.fixture(scope="module")
def model_path(tokenizer, tmp_path_factory):
    """A tiny random Qwen3-shaped model over the Qwen3 tokenizer's vocabulary (what it samples is noise)."""
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("m") / "ckpt", vocab_size=len(tokenizer))


@pytest.fixture()
def tool_config(tmp_path):
    (tmp_path / "echo_tool.py").write_text(TOOL_FILE)
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML.format(tool_file=tmp_path / "echo_tool.py"))
    return str(path)


def _always_calls(text: str) -> ParsedTurn:
    """A parser for noise models: every turn calls `echo` with its text's first letters (or fails on cue)."""
    return ParsedTurn(text, [FunctionCall("echo", {"text": text[:3]})], [])


@pytest.fixture()
def always_calls(monkeypatch):
    monkeypatch.setitem(parsers.PARSERS, "always_calls", _always_calls)
    return "always_calls"


def _engine(model_path, max_model_len=PROMPT_LEN + RESPONSE_LEN):
    return Engine.from_pretrained(model_path, Layout.single(), EngineConfig(
        max_model_len=max_model_len, max_num_batched_tokens=4096, cpu_kv_cache_tokens=max_model_len * 16))


def _prompts(tokenizer, texts, renderer, agent_name=None, extra=None):
    rows = []
    for text in texts:
        messages = [{"role": "user", "content": text}]
        rows.append((messages, renderer.prompt_ids(messages)))
    padded = [left_pad(ids, PROMPT_LEN, tokenizer.pad_token_id) for _, ids in rows]
    input_ids, attention_mask, position_ids = (torch.stack(c) for c in zip(*padded))
    non_tensors = {"raw_prompt": [m for m, _ in rows], "extra_info": [dict(extra or {}) for _ in rows]}
    if agent_name is not None:
        non_tensors["agent_name"] = agent_name if isinstance(agent_name, list) else [agent_name] * len(rows)
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
                 non_tensors)


def _record_engine_outputs(engine):
    """Every finished request's sampled ids, as the engine returned them (the reference for exactness)."""
    sampled = {}
    step = engine.step

    def recording_step():
        outs = step()
        for out in outs:
            sampled[out.request_id] = list(out.token_ids)
        return outs

    engine.step = recording_step
    return sampled


def test_trajectories_are_the_engines_ids_plus_the_environments(tokenizer, model_path, tool_config, always_calls):
    engine = _engine(model_path)
    sampled = _record_engine_outputs(engine)
    limits = TurnLimits(response_length=RESPONSE_LEN, max_assistant_turns=3, max_tool_response_length=40)
    settings = AgentSettings(limits, str(QWEN3), always_calls, tool_config, default_agent_loop="tool_agent")
    runner = build_runner(engine, settings)
    renderer = runner.context.renderer
    prompts = _prompts(tokenizer, ["Say 12", "Add 3 and 4", "Hello there"], renderer,
                       extra={"tools_kwargs": {"echo": {"create_kwargs": {"prefix": "> "}}}})
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=row) for row in range(len(prompts))]
    batch = generate_trajectories(runner, prompts, params, RESPONSE_LEN, tokenizer.pad_token_id)
    t = batch.tensors
    turns = sorted(sampled)  # "traj<i>/<turn>"
    for row in range(len(prompts)):
        session = sorted({rid.split("/")[0] for rid in turns})[row]
        model_turns = [sampled[rid] for rid in turns if rid.startswith(session + "/")]
        # Rebuild the trajectory from the engine's ids and independently rendered environment turns.
        expected, mask, messages = [], [], []
        for i, ids in enumerate(model_turns):
            expected += ids
            mask += [1] * len(ids)
            if i + 1 < len(model_turns):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                reply = [{"role": "tool", "content": "> " + text[:3] * 2}]
                env = renderer.env_ids(reply, ids)
                expected += env
                mask += [0] * len(env)
        length = int(t["attention_mask"][row, PROMPT_LEN:].sum())
        assert t["responses"][row, :length].tolist() == expected
        assert t["response_mask"][row, :length].tolist() == mask
        prompt = t["input_ids"][row][t["attention_mask"][row].bool()].tolist()
        assert prompt == renderer.prompt_ids(prompts.non_tensors["raw_prompt"][row]) + expected
        assert (t["rollout_log_probs"][row, :length][torch.tensor(mask) == 0] == 0).all()
        assert (t["policy_versions"][row, :length][torch.tensor(mask) == 0] == -1).all()
        sources = t["response_sources"][row, :length].tolist()
        assert sources == [Source.MODEL if m else Source.TOOL for m in mask]
    assert float(t["agent_tool_calls"].sum()) > 0 and float(t["agent_tool_errors"].sum()) == 0


def test_a_turn_that_does_not_round_trip_is_kept_as_sampled(tokenizer, tool_config, always_calls):
    """The model sampled " hel" + "lo" (decoding to " hello", which the tokenizer encodes as one token) and then
    "\n" + "\n" before its end-of-turn: the trajectory keeps those ids, where decode -> encode of the same
    conversation gives other ids."""
    settings = AgentSettings(TurnLimits(response_length=64, max_assistant_turns=2), str(QWEN3), always_calls,
                             tool_config, default_agent_loop="tool_agent")
    runner = build_runner(_NoEngine(), settings)
    ids = lambda text: tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))  # noqa: E731
    turns = [ids(" hel") + ids("lo") + ids("\n") + ids("\n") + [tokenizer.convert_tokens_to_ids("<|im_end|>")],
             ids(" 1") + ids("2") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]]
    assert tokenizer(" hello", add_special_tokens=False)["input_ids"] != turns[0][:2]
    scripted = iter(turns)

    async def generate(prompt_ids, params):
        out = next(scripted)
        return RequestOutput("r", prompt_ids, out, [-0.5] * len(out), None, [0] * len(out), "stop", True)

    prompt = runner.context.renderer.prompt_ids([{"role": "user", "content": "hi"}])
    sample = AgentSample([{"role": "user", "content": "hi"}], prompt, {}, SamplingParams(max_tokens=64))
    episode = Episode(sample, generate, runner.decode, 64)
    asyncio.run(runner.loops["tool_agent"].run(episode))
    traj = episode.trajectory
    env = runner.context.renderer.env_ids([{"role": "tool", "content": " he" * 2}], turns[0])
    assert traj.response_ids == turns[0] + env + turns[1]
    assert traj.response_mask == [1] * len(turns[0]) + [0] * len(env) + [1] * len(turns[1])
    text = tokenizer.decode(prompt + traj.response_ids)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != prompt + traj.response_ids


class _NoEngine:
    """An engine stand-in for a runner whose loops are driven by hand (never stepped)."""


def test_environment_tokens_get_no_gradient(tokenizer, model_path, tool_config, always_calls):
    engine = _engine(model_path)
    settings = AgentSettings(TurnLimits(response_length=RESPONSE_LEN, max_assistant_turns=3), str(QWEN3),
                             always_calls, tool_config, default_agent_loop="tool_agent")
    runner = build_runner(engine, settings)
    prompts = _prompts(tokenizer, ["a b c", "d e f"], runner.context.renderer)
    batch = generate_trajectories(runner, prompts, [SamplingParams(max_tokens=8, seed=i) for i in range(2)],
                                  RESPONSE_LEN, tokenizer.pad_token_id)
    t = batch.tensors
    mask, responses = t["response_mask"], t["responses"]
    env = (t["attention_mask"][:, PROMPT_LEN:] == 1) & (mask == 0)
    assert env.any()
    logits = torch.randn(*responses.shape, 64, requires_grad=True)  # a small vocab stands in: ids mod 64
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        logits.grad = None
        log_probs = torch.log_softmax(logits, -1)
        token_log_prob = log_probs.gather(-1, (responses % 64).unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        loss, _ = actor_loss(token_log_prob, token_log_prob.detach() - 0.1, torch.randn(mask.shape), mask,
                             LossScale.from_mask(mask, RESPONSE_LEN), mode, ClipRange(0.2), entropy=entropy,
                             entropy_coeff=0.01, ref_log_prob=token_log_prob.detach() + 0.2, kl_loss_coef=0.1,
                             kl_loss_type="low_var_kl")
        loss.backward()
        assert (logits.grad[env] == 0).all()
        assert (logits.grad[mask.bool()].abs().sum(-1) > 0).all()


@register("sleepy_agent")
class SleepyAgentLoop(AgentLoop):
    """One model turn, a 2 s wait (a slow tool), one more model turn."""

    async def run(self, episode: Episode) -> None:
        await episode.generate()
        await asyncio.sleep(2.0)
        episode.append([1, 2, 3], Source.TOOL)
        await episode.generate()


LONG_TRAJECTORIES_DONE: list[int] = []


@register("counted_single_turn_agent")
class CountedSingleTurnAgentLoop(AgentLoop):
    """One model turn, then a mark that it finished (what the waiting agent below waits for)."""

    async def run(self, episode: Episode) -> None:
        await episode.generate()
        LONG_TRAJECTORIES_DONE.append(1)


@register("waits_for_the_others_agent")
class WaitsForTheOthersAgentLoop(AgentLoop):
    """One model turn, then a 'tool' that answers only once the three long trajectories have finished (or 120 s
    passed): an engine that stalled on a waiting trajectory would decode nothing in the wait."""

    async def run(self, episode: Episode) -> None:
        await episode.generate()
        deadline = time.monotonic() + 120.0
        while len(LONG_TRAJECTORIES_DONE) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        episode.append([1, 2, 3], Source.TOOL)
        await episode.generate()


def test_a_slow_tool_does_not_stall_the_other_trajectories(tokenizer, model_path):
    engine = _engine(model_path, max_model_len=PROMPT_LEN + 400)
    limits = TurnLimits(response_length=400)
    runner = build_runner(engine, AgentSettings(limits, str(QWEN3)))
    names = ["waits_for_the_others_agent"] + ["counted_single_turn_agent"] * 3
    prompts = _prompts(tokenizer, ["wait", "go on", "and on", "more"], runner.context.renderer, names)
    params = [SamplingParams(max_tokens=4, ignore_eos=True, seed=0)] + [
        SamplingParams(max_tokens=300, ignore_eos=True, seed=i) for i in range(1, 4)]
    LONG_TRAJECTORIES_DONE.clear()
    generate_trajectories(runner, prompts, params, 400, tokenizer.pad_token_id)
    assert len(LONG_TRAJECTORIES_DONE) == 3
    stats = runner.take_stats()
    # The long trajectories decoded through the wait: all of their 300 steps but the first 4 (the waiting
    # trajectory's own first turn) fall in it, however fast or slow the machine.
    assert stats.decode_steps_during_tools >= 290
    assert runner.take_stats().decode_steps_during_tools == 0  # taken: the next call starts from zero


def test_a_wait_nothing_else_covers_is_idle_time_on_the_timeline(tokenizer, model_path):
    engine = _engine(model_path)
    runner = build_runner(engine, AgentSettings(TurnLimits(response_length=RESPONSE_LEN), str(QWEN3)))
    prompts = _prompts(tokenizer, ["wait"], runner.context.renderer, "sleepy_agent")
    generate_trajectories(runner, prompts, [SamplingParams(max_tokens=4, ignore_eos=True, seed=0)], RESPONSE_LEN,
                          tokenizer.pad_token_id)
    stats = runner.take_stats()
    assert 1.9 <= stats.tool_idle_seconds <= 3.0 and stats.decode_steps_during_tools == 0
    assert sum(end - begin for begin, end in stats.tool_idle_spans) == pytest.approx(stats.tool_idle_seconds)


def test_tool_failures_are_answered_and_counted(tokenizer, model_path, tool_config, monkeypatch):
    cues = iter(["boom", "slow", "nope"])

    def cued(text):
        cue = next(cues, None)
        if cue == "nope":
            return ParsedTurn(text, [FunctionCall("missing_tool", {})], ["Error: tool call 2 is not valid JSON"])
        return ParsedTurn(text, [FunctionCall("echo", {"text": cue})] if cue else [], [])

    monkeypatch.setitem(parsers.PARSERS, "cued", cued)
    engine = _engine(model_path, PROMPT_LEN + 200)
    limits = TurnLimits(response_length=200, tool_timeout=0.5, max_parallel_calls=2)
    runner = build_runner(engine, AgentSettings(limits, str(QWEN3), "cued", tool_config,
                                                default_agent_loop="tool_agent"))
    prompts = _prompts(tokenizer, ["x"], runner.context.renderer)
    batch = generate_trajectories(runner, prompts, [SamplingParams(max_tokens=4, ignore_eos=True, seed=3)],
                                  200, tokenizer.pad_token_id)
    t = batch.tensors
    assert t["agent_tool_calls"][0] == 3  # boom, slow, missing_tool
    assert t["agent_tool_timeouts"][0] == 1
    assert t["agent_tool_errors"][0] == 3  # the exception, the unknown tool, the malformed call
    text = tokenizer.decode(t["responses"][0][t["attention_mask"][0, PROMPT_LEN:].bool()])
    assert t["agent_assistant_turns"][0] == 4  # three answered turns, then one without calls
    for expected in ("the tool broke", "timed out after 0.5 s", "no tool named 'missing_tool'", "not valid JSON"):
        assert expected in text
    assert batch.non_tensors["extra_info"][0]["num_turns"] == t["agent_turns"][0]


def test_interaction_answers_turns_without_calls(tokenizer, model_path, tmp_path):
    (tmp_path / "judge.py").write_text(INTERACTION_FILE)
    config = tmp_path / "interaction.yaml"
    config.write_text(INTERACTION_YAML.format(file=tmp_path / "judge.py"))
    engine = _engine(model_path, PROMPT_LEN + 200)
    settings = AgentSettings(TurnLimits(response_length=200), str(QWEN3),
                             interaction_config_path=str(config), default_agent_loop="tool_agent")
    runner = build_runner(engine, settings)
    prompts = _prompts(tokenizer, ["q"], runner.context.renderer, extra={"interaction_kwargs": {"name": "judge"}})
    batch = generate_trajectories(runner, prompts, [SamplingParams(max_tokens=4, ignore_eos=True, seed=5)],
                                  200, tokenizer.pad_token_id)
    info = batch.non_tensors["extra_info"][0]
    assert info["turn_scores"] == [0.25, 0.5, 0.75]  # two answers, then the judge ends it with its third score
    sources = batch.tensors["response_sources"][0].tolist()
    assert sources.count(Source.USER) > 0 and Source.TOOL not in sources
    text = tokenizer.decode(batch.tensors["responses"][0][batch.tensors["attention_mask"][0, PROMPT_LEN:].bool()])
    assert "try again 1" in text and "try again 2" in text and "try again 3" not in text


def test_weights_updated_mid_trajectory_keep_versions_monotone(tokenizer, model_path, tool_config, always_calls):
    """A weight sync between drives (abort, new version, resume: what RolloutWorker.sync_weights does) while
    trajectories are mid turn or waiting on tools: later tokens carry the new version, none an older one after a
    newer, and the finished samples respect a staleness bound of 1 per token."""
    engine = _engine(model_path)
    settings = AgentSettings(TurnLimits(response_length=RESPONSE_LEN, max_assistant_turns=4), str(QWEN3),
                             always_calls, tool_config, default_agent_loop="tool_agent")
    runner = build_runner(engine, settings)
    prompts = _prompts(tokenizer, ["one", "two", "three", "four"], runner.context.renderer)
    from shardrl.workers.samples import agent_samples, trajectories_batch
    samples = agent_samples(prompts, [SamplingParams(max_tokens=6, ignore_eos=True, seed=i) for i in range(4)])
    runner.start(samples)
    done = runner.drive(5)
    engine.abort(keep=True)
    engine.set_policy_version(1)
    engine.resume()
    while runner.pending():
        done |= runner.drive(None)
    trajectories = [done[row] for row in range(4)]
    batch = trajectories_batch(prompts, trajectories, RESPONSE_LEN, tokenizer.pad_token_id)
    versions, mask = batch.tensors["policy_versions"], batch.tensors["response_mask"].bool()
    saw_update = False
    for row in range(4):
        model_versions = versions[row][mask[row]].tolist()
        assert model_versions == sorted(model_versions)
        saw_update |= 1 in model_versions
        assert min(model_versions) >= 1 - 1  # staleness bound 1: no token older than version 0
    assert saw_update


PYTHON_TOOL_YAML = """tools:
  - class_name: shardrl.agents.builtin_tools.PythonTool
    config: {type: native, wall_seconds: 2, cpu_seconds: 1, memory_mb: 256, max_output_bytes: 2000}
"""


def test_sandboxed_code_that_misbehaves_is_answered_and_the_trajectory_goes_on(tokenizer, model_path, tmp_path,
                                                                               monkeypatch):
    """The model's code loops forever, then prints without end: each call is stopped, the model reads why in its
    next turn, and the trajectory ends normally."""
    codes = iter(["while True: pass", "while True: print('x' * 1000)", "print(6 * 7)"])

    def cued(text):
        code = next(codes, None)
        return ParsedTurn(text, [FunctionCall("code_interpreter", {"code": code})] if code else [], [])

    monkeypatch.setitem(parsers.PARSERS, "cued_code", cued)
    (tmp_path / "python.yaml").write_text(PYTHON_TOOL_YAML)
    engine = _engine(model_path, PROMPT_LEN + 400)
    limits = TurnLimits(response_length=400, tool_timeout=10, max_tool_response_length=120)
    runner = build_runner(engine, AgentSettings(limits, str(QWEN3), "cued_code", str(tmp_path / "python.yaml"),
                                                default_agent_loop="tool_agent"))
    prompts = _prompts(tokenizer, ["compute"], runner.context.renderer)
    batch = generate_trajectories(runner, prompts, [SamplingParams(max_tokens=4, ignore_eos=True, seed=1)], 400,
                                  tokenizer.pad_token_id)
    t = batch.tensors
    text = tokenizer.decode(t["responses"][0][t["attention_mask"][0, PROMPT_LEN:].bool()])
    assert t["agent_tool_calls"][0] == 3 and t["agent_loop_errors"][0] == 0
    assert "time limit" in text.lower() or "timed out" in text.lower()
    assert "42" in text  # the well-behaved call after them still runs
    assert batch.non_tensors["finish_reason"][0] != "error"
