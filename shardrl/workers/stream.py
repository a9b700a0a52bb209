"""Streaming generation on one engine replica: requests go in, and each call returns the samples that finished
during it, so the controller can act on a sample (score it, hand it to the trainer) while the others still decode.

Both rollout placements stream through `SampleStream`: the detached pool's `RolloutWorker.stream` (the async modes'
rollouter) and the hybrid engine's `ActorRolloutRefWorker.stream_sequences` (the synchronous step that scores each
sample as it finishes, `reward_model.use_reward_loop`). Samples keep their prompt row's columns, `sample_seed`
included, which orders them back into their batch.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from shardrl.agents.driver import AgentRunner
from shardrl.data.batch import Batch
from shardrl.rollout.engine import Engine, EngineStats
from shardrl.rollout.request import SamplingParams
from shardrl.workers.samples import agent_samples, prompt_ids_of, samples_batch, trajectories_batch

REFILL_CHUNK = 8  # with a backlog, new requests enter the engine once 1/8 of its slots are free
Backlog = deque[tuple[list[int], SamplingParams, Batch]]  # (prompt ids, sampling params, prompt row) per request


class SampleStream:
    """Requests of one engine replica, single-turn or (with `agents`) agent trajectories, from `add` to the call of
    `run` in which they finish."""

    def __init__(self, engine: Engine, agents: AgentRunner | None, response_length: int, pad_token_id: int) -> None:
        self.engine, self.agents = engine, agents
        self.response_length, self.pad_token_id = response_length, pad_token_id
        self.rows: dict[str, Batch] = {}  # request id / trajectory key -> its prompt row, while it runs
        self.backlog: Backlog = deque()  # requests not yet in the engine
        self.started = 0  # trajectories started (their keys)

    def add(self, prompts: Batch, params: list[SamplingParams], refill: bool) -> None:
        """One request (or trajectory) per row. With `refill` single-turn requests wait in a backlog and enter the
        engine in refill chunks (`admit`: the streaming rollouter keeps the engine full without a prefill per
        finished sequence); without, they all go to the engine's own queue at once, as `Engine.generate` does."""
        if self.agents is not None:
            samples = []
            for row, sample, name in agent_samples(prompts, params):
                key = f"s{self.started}"
                self.started += 1
                self.rows[key] = prompts.take([row])
                samples.append((key, sample, name))
            self.agents.start(samples)
            return
        requests = [(ids, p, prompts.take([row])) for row, (ids, p) in enumerate(zip(prompt_ids_of(prompts), params))]
        if refill:
            self.backlog.extend(requests)
            return
        for ids, p, row in requests:
            self.rows[self.engine.submit(ids, p)[0]] = row

    def busy(self) -> bool:
        """Whether any request added is not yet returned."""
        if self.agents is not None:
            return self.agents.pending() > 0
        return bool(self.backlog) or self.engine.has_unfinished()

    def run(self, max_steps: int) -> tuple[Batch | None, dict[str, Any]]:
        """At most `max_steps` engine steps (fewer when the engine runs out of work); the samples that finished
        meanwhile (None if none did) and what the engine did (`rollouter.ENGINE_KEYS`, and its `slots`)."""
        self.engine.stats = EngineStats()
        if self.agents is not None:
            return self._run_trajectories(max_steps)
        finished = []
        for _ in range(max_steps):
            admit(self.engine, self.backlog, self.rows)
            if not self.engine.has_unfinished():
                break
            finished += self.engine.step()
        report = self._report()
        if not finished:
            return None, report
        rows = Batch.concat([self.rows.pop(out.request_id) for out in finished])
        return samples_batch(rows, finished, self.response_length, self.pad_token_id), report

    def _run_trajectories(self, max_steps: int) -> tuple[Batch | None, dict[str, Any]]:
        finished = self.agents.drive(max_steps)
        agent = self.agents.take_stats()
        report = self._report() | {"tool_idle_s": agent.tool_idle_seconds,
                                   "decode_steps_during_tools": agent.decode_steps_during_tools,
                                   "tool_idle_spans": agent.tool_idle_spans}
        if not finished:
            return None, report
        rows = Batch.concat([self.rows.pop(key) for key in finished])
        return trajectories_batch(rows, list(finished.values()), self.response_length, self.pad_token_id), report

    def _report(self) -> dict[str, Any]:
        stats = self.engine.stats
        return {"engine_s": stats.prefill_seconds + stats.decode_seconds, "prefill_s": stats.prefill_seconds,
                "decode_steps": stats.decode_steps, "decode_rows": stats.decode_tokens,
                "prefill_tokens": stats.prefill_tokens, "graph_capture_s": stats.graph_capture_seconds,
                "slots": self.engine.max_running, "tool_idle_s": 0.0, "decode_steps_during_tools": 0,
                "tool_idle_spans": []}


def admit(engine: Engine, backlog: Backlog, rows: dict[str, Batch]) -> None:
    """Move requests from `backlog` into `engine` (recording each one's prompt row under its request id): as many as
    have a free slot, once `slots / REFILL_CHUNK` slots are free or the whole backlog fits. Each admission is a
    prefill step that stalls every running sequence's decode, so the slots that finishing sequences free are refilled
    in batches rather than with one prefill per finished sequence; the engine stays at least 7/8 full meanwhile."""
    free = engine.free_capacity()
    if not backlog or free < min(-(-engine.max_running // REFILL_CHUNK), len(backlog)):
        return
    for _ in range(min(free, len(backlog))):
        ids, params, row = backlog.popleft()
        rows[engine.submit(ids, params)[0]] = row
