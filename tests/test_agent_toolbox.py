"""The tool box every trajectory of a worker shares: verl's truncation sides, the concurrency limit over all
trajectories, per-call timeouts covering create and execute, releases that always run, and the episode's budget."""

import asyncio
import time

import pytest

from shardrl.agents.loop import AgentData, AgentLoopError, AgentSample, Episode, ToolBox, TurnLimits
from shardrl.agents.parsers import FunctionCall
from shardrl.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from shardrl.agents.trajectory import Source
from shardrl.rollout.request import RequestOutput, SamplingParams


def _schema(name):
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": name}})


class CountingTool(BaseTool):
    """Sleeps `delay` per call and records how many calls overlap."""

    def __init__(self, name, delay):
        super().__init__({}, _schema(name))
        self.delay, self.running, self.peak, self.released = delay, 0, 0, []

    async def execute(self, instance_id, parameters, **kwargs):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.running -= 1
        return ToolResponse(text=parameters.get("text", "done")), 1.0, {}

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)


def _data():
    return AgentData([], "r", {})


@pytest.mark.parametrize("side, expected", [("left", "abcde...(truncated)"), ("right", "(truncated)...fghij"),
                                            ("middle", "ab...(truncated)...ij")])
def test_truncation_sides_are_verls(side, expected):
    box = ToolBox([], TurnLimits(response_length=8, max_tool_response_length=5, tool_response_truncate_side=side))
    assert box.truncate("abcdefghij") == expected and box.truncate("abc") == "abc"


def test_calls_of_all_trajectories_share_the_concurrency_limit():
    tool = CountingTool("slow", 0.05)
    box = ToolBox([tool], TurnLimits(response_length=8, max_concurrent_tool_calls=3))

    async def many():
        return await asyncio.gather(*(box.call(FunctionCall("slow", {"text": str(i)}), _data()) for i in range(12)))

    start = time.perf_counter()
    results = asyncio.run(many())
    assert tool.peak == 3 and time.perf_counter() - start >= 4 * 0.05
    assert [r.text for r in results] == [str(i) for i in range(12)] and all(r.reward == 1.0 for r in results)
    assert len(tool.released) == 12


def test_a_timeout_covers_the_call_and_still_releases():
    tool = CountingTool("stuck", 5.0)
    box = ToolBox([tool], TurnLimits(response_length=8, tool_timeout=0.1))
    result = asyncio.run(box.call(FunctionCall("stuck", {}), _data()))
    assert result.timed_out and result.error and "timed out after 0.1 s" in result.text
    deadline = time.perf_counter() + 2.0  # the cancelled call unwinds on the tools' own loop
    while not tool.released and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert len(tool.released) == 1 and tool.running == 0


def test_an_episode_caps_turns_by_its_budget_and_refuses_past_it():
    asked = []

    async def generate(prompt_ids, params):
        asked.append(params.max_tokens)
        return RequestOutput("r", prompt_ids, [7] * params.max_tokens, [0.0] * params.max_tokens, None,
                             [0] * params.max_tokens, "length", True)

    episode = Episode(AgentSample([], [1], {}, SamplingParams(max_tokens=3)), generate, lambda ids: "", 6)
    asyncio.run(episode.generate())
    assert not episode.append([9, 9, 9], Source.TOOL)  # would leave no room for a model token
    assert episode.append([9], Source.TOOL) and episode.remaining == 2
    asyncio.run(episode.generate())
    assert asked == [3, 2]  # the sample's per-turn cap, then what was left
    assert episode.trajectory.response_ids == [7, 7, 7, 9, 7, 7] and episode.remaining == 0
    with pytest.raises(AgentLoopError, match="response budget"):
        asyncio.run(episode.generate())


class BlockingTool(BaseTool):
    """A tool written wrongly: it blocks its thread (a synchronous sleep) inside its coroutine."""

    def __init__(self, seconds):
        super().__init__({}, _schema("blocking"))
        self.seconds = seconds

    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(self.seconds)
        return ToolResponse(text="late"), 0.0, {}


def test_a_tool_that_blocks_its_thread_neither_stalls_the_caller_nor_escapes_its_timeout():
    box = ToolBox([BlockingTool(1.5)], TurnLimits(response_length=8, tool_timeout=0.3))

    async def call_and_tick():
        ticks = 0

        async def ticker():  # the runner's loop: it must keep running while the tool blocks
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.ensure_future(ticker())
        start = time.perf_counter()
        result = await box.call(FunctionCall("blocking", {}), _data())
        elapsed = time.perf_counter() - start
        ticking.cancel()
        return result, elapsed, ticks

    result, elapsed, ticks = asyncio.run(call_and_tick())
    assert result.timed_out and elapsed < 1.0  # timed out at 0.3 s, not after the 1.5 s block
    assert ticks >= 15  # the caller's loop ran all along


def test_a_turn_the_engine_refuses_fails_its_trajectory_alone(tmp_path):
    """A trajectory that outgrows the engine's max_model_len (a user loop appending past it) ends as a loop error,
    marked and counted; the runner and the other trajectories go on."""
    from shardrl.agents.driver import AgentRunner
    from shardrl.agents.loop import AgentContext, AgentLoop, SingleTurnAgentLoop
    from shardrl.models.tiny import make_tiny_checkpoint
    from shardrl.parallel.layout import Layout
    from shardrl.rollout.engine import Engine, EngineConfig

    class Overgrowing(AgentLoop):
        async def run(self, episode):
            await episode.generate()
            episode.append(list(range(1, 40)), Source.TOOL)
            await episode.generate()

    engine = Engine.from_pretrained(make_tiny_checkpoint("qwen2", tmp_path / "m"), Layout.single(),
                                    EngineConfig(max_model_len=32, max_num_batched_tokens=64))
    limits = TurnLimits(response_length=100)
    context = AgentContext(None, None, ToolBox([], limits), {}, limits)
    runner = AgentRunner(engine, context, {"grow": Overgrowing(context), "one": SingleTurnAgentLoop(context)},
                         "one", lambda ids: "")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    runner.start([(0, AgentSample([], [1, 2, 3], {}, params), "grow"), (1, AgentSample([], [4, 5], {}, params), None)])
    done = runner.drive(None)
    assert done[0].error is not None and "max_model_len" in done[0].error and done[0].finish_reason == "error"
    assert done[1].error is None and len(done[1].response_ids) == 4
