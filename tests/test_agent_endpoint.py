"""External agents through the OpenAI-compatible endpoint, on the real engine (CPU): agent functions (in their own
processes, with the `openai` client) run multi-turn episodes whose trained tokens are the served ones token for
token with the served log-probs; a client that edits its history is flagged and the edited part masked; bad
requests get 4xx while the engine serves the others; failing agents fail only their episode."""

import json

import pytest

from shardrl.agents.driver import AgentSettings, build_runner
from shardrl.agents.endpoint import EndpointSettings
from shardrl.agents.loop import TurnLimits
from shardrl.agents.render import TurnRenderer
from shardrl.agents.trajectory import Source
from shardrl.rewards.manager import compute_token_level_scores
from shardrl.rollout.request import SamplingParams
from shardrl.workers.samples import generate_trajectories
from test_agent_loop import (PROMPT_LEN, QWEN3, TOOL_FILE, TOOLS_YAML, _engine, _prompts, _record_engine_outputs,
                             always_calls, model_path, tokenizer)  # noqa: F401 (fixtures)

pytest.importorskip("openai")
RESPONSE_LEN = 64
# The agent: three requests, each answered with a tool result (when the endpoint returned calls) or a user turn;
# it writes what it was served to extra_info.out and returns a reward. With extra_info.edit it re-sends the third
# request with its second assistant message changed.
AGENT = '''
import json, os
from openai import OpenAI

def run(episode):
    info = episode.extra_info
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    messages, served = list(episode.messages), []
    tools = episode.tools if info.get("tools") else None
    for turn in range(3):
        if info.get("edit") and turn == 2:
            messages[3] = dict(messages[3], content="EDITED by the client")
        reply = client.chat.completions.create(model=episode.model, messages=messages, tools=tools, max_tokens=5,
                                               logprobs=True, seed=100 * info["row"] + turn)
        choice = reply.choices[0]
        served.append({"logprobs": [t.logprob for t in choice.logprobs.content],
                       "tokens": [t.token for t in choice.logprobs.content], "content": choice.message.content,
                       "finish": choice.finish_reason, "calls": len(choice.message.tool_calls or [])})
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": f"result {turn}"}
                         for c in choice.message.tool_calls]
        else:
            messages.append({"role": "user", "content": f"go on {turn}"})
    with open(os.path.join(info["out"], f"{info['row']}.json"), "w") as f:
        json.dump({"served": served, "messages": messages}, f)
    return 0.25 * info["row"]
'''


def _runner(tmp_path, model_path, agent_source, parser="hermes", endpoint=EndpointSettings(num_workers=2)):
    (tmp_path / "agent.py").write_text(agent_source)
    (tmp_path / "loops.yaml").write_text("- name: openai_agent\n  function: agent.py:run\n")
    (tmp_path / "echo_tool.py").write_text(TOOL_FILE)
    (tmp_path / "tools.yaml").write_text(TOOLS_YAML.format(tool_file=tmp_path / "echo_tool.py"))
    engine = _engine(model_path, PROMPT_LEN + RESPONSE_LEN)
    sampled = _record_engine_outputs(engine)
    settings = AgentSettings(TurnLimits(response_length=RESPONSE_LEN, prompt_length=PROMPT_LEN), str(QWEN3), parser,
                             str(tmp_path / "tools.yaml"), agent_loop_config_path=str(tmp_path / "loops.yaml"),
                             default_agent_loop="openai_agent", endpoint=endpoint)
    return build_runner(engine, settings), sampled


def _run(runner, tokenizer, tmp_path, extras):
    prompts = _prompts(tokenizer, [f"question {i}" for i in range(len(extras))], runner.context.renderer)
    prompts.non_tensors["extra_info"] = [{"row": i, "out": str(tmp_path), **extra} for i, extra in enumerate(extras)]
    params = [SamplingParams(max_tokens=RESPONSE_LEN, temperature=1.0) for _ in extras]
    return generate_trajectories(runner, prompts, params, RESPONSE_LEN, tokenizer.pad_token_id)


def _turns_of(sampled, row):
    """The engine's sampled ids of trajectory `row`'s turns, in order (request ids "traj<k>/<turn>")."""
    sessions = sorted({rid.split("/")[0] for rid in sampled}, key=lambda s: int(s[4:]))
    ids = sorted((rid for rid in sampled if rid.startswith(sessions[row] + "/")), key=lambda r: int(r.split("/")[1]))
    return [sampled[rid] for rid in ids]


def _response(batch, row):
    t = batch.tensors
    length = int(t["attention_mask"][row, PROMPT_LEN:].sum())
    return (t["responses"][row, :length].tolist(), t["response_mask"][row, :length].tolist(),
            t["rollout_log_probs"][row, :length].tolist(), t["response_sources"][row, :length].tolist())


def test_served_turns_are_the_trained_tokens(tmp_path, tokenizer, model_path, always_calls):
    runner, sampled = _runner(tmp_path, model_path, AGENT, always_calls)
    try:
        batch = _run(runner, tokenizer, tmp_path, [{"tools": True}, {"tools": False}, {"tools": True}])
    finally:
        runner.close()
    schemas = runner.context.toolbox.schemas
    for row in range(3):
        record = json.loads((tmp_path / f"{row}.json").read_text())
        served, messages = record["served"], record["messages"]
        renderer = TurnRenderer(tokenizer, schemas if row != 1 else None)
        model_turns = _turns_of(sampled, row)
        assert len(model_turns) == 3
        # The trajectory rebuilt from the engine's ids and the environment's messages rendered on their own.
        expected, mask, sources = [], [], []
        assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for turn, ids in enumerate(model_turns):
            expected += ids
            mask += [1] * len(ids)
            sources += [Source.MODEL] * len(ids)
            if turn < 2:
                env_messages = messages[assistant_at[turn] + 1:assistant_at[turn + 1]]
                env = renderer.env_ids([{"role": m["role"], "content": m["content"]} for m in env_messages], ids)
                expected += env
                mask += [0] * len(env)
                sources += [Source.TOOL if row != 1 else Source.USER] * len(env)
        responses, response_mask, logprobs, response_sources = _response(batch, row)
        assert responses == expected and response_mask == mask and response_sources == sources
        t = batch.tensors
        prompt = t["input_ids"][row, :PROMPT_LEN][t["attention_mask"][row, :PROMPT_LEN].bool()].tolist()
        assert prompt == renderer.prompt_ids(messages[:1])
        served_logprobs = [lp for turn in served for lp in turn["logprobs"]]
        assert [lp for lp, m in zip(logprobs, mask) if m] == pytest.approx(served_logprobs, abs=1e-6)
        assert [tok for turn in served for tok in turn["tokens"]] == [
            tokenizer.decode([i]) for ids in model_turns for i in ids]
        assert all(turn["calls"] == (row != 1) for turn in served)
        assert all(turn["finish"] == ("tool_calls" if row != 1 else "length") or turn["finish"] == "stop"
                   for turn in served)
        assert t["agent_requests"][row] == 3 and t["agent_divergent_requests"][row] == 0
        assert batch.non_tensors["extra_info"][row]["agent_reward"] == 0.25 * row
    # Re-tokenising would not give the sampled ids back: the test above would catch a decode -> encode.
    all_model = [i for row in range(3) for ids in _turns_of(sampled, row) for i in ids]
    assert tokenizer(tokenizer.decode(all_model), add_special_tokens=False)["input_ids"] != all_model


def test_an_edited_history_is_flagged_and_masked(tmp_path, tokenizer, model_path):
    runner, sampled = _runner(tmp_path, model_path, AGENT)
    try:
        batch = _run(runner, tokenizer, tmp_path, [{"edit": True}, {}])
    finally:
        runner.close()
    record = json.loads((tmp_path / "0.json").read_text())
    messages = record["messages"]  # as sent last: the second assistant message edited
    assert messages[3]["content"] == "EDITED by the client"
    first, _, third = _turns_of(sampled, 0)
    renderer = TurnRenderer(tokenizer)
    rewritten = renderer.rewritten_ids([{"role": m["role"], "content": m.get("content") or ""}
                                        for m in messages[2:5]], first)
    responses, mask, _, sources = _response(batch, 0)
    # Kept: the first model turn (before the edit); masked: everything from the edit's turn on; then the new turn.
    assert responses == first + rewritten + third
    assert mask == [1] * len(first) + [0] * len(rewritten) + [1] * len(third)
    assert sources[len(first):len(first) + len(rewritten)] == [Source.REWRITTEN] * len(rewritten)
    assert "EDITED by the client" in tokenizer.decode(rewritten)
    t = batch.tensors
    assert t["agent_divergent_requests"].tolist() == [1, 0]


BAD_REQUESTS = '''
import json, os, urllib.request, urllib.error
from openai import OpenAI

def post(url, body, key="secret", raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["error"]["message"]

def run(episode):
    info, url = episode.extra_info, episode.base_url + "/chat/completions"
    good = {"model": episode.model, "messages": episode.messages, "max_tokens": 3}
    if info["row"] == 0:
        root = episode.base_url.split("/sessions/")[0]
        results = {
            "unknown model": post(url, dict(good, model="gpt-4o")),
            "messages not a list": post(url, dict(good, messages="hello")),
            "bad role": post(url, dict(good, messages=[{"role": "wizard", "content": "x"}])),
            "negative max_tokens": post(url, dict(good, max_tokens=-1)),
            "n=2": post(url, dict(good, n=2)),
            "not json": post(url, None, raw=b"{not json"),
            "oversize": post(url, dict(good, padding="x" * (2 << 20))),
            "wrong key": post(url, good, key="guess"),
            "no session": post(root + "/v1/chat/completions", good),
            "closed session": post(root + "/sessions/nope/v1/chat/completions", good),
        }
        with open(os.path.join(info["out"], "bad.json"), "w") as f:
            json.dump(results, f)
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    assert [m.id for m in client.models.list().data] == [episode.model]
    for _ in range(2):
        reply = client.chat.completions.create(model=episode.model, messages=good["messages"], max_tokens=3)
    return 1.0
'''


def test_bad_requests_get_4xx_and_the_engine_keeps_serving(tmp_path, tokenizer, model_path):
    endpoint = EndpointSettings(num_workers=2, api_key="secret", max_body_mb=1)
    runner, sampled = _runner(tmp_path, model_path, BAD_REQUESTS, endpoint=endpoint)
    try:
        batch = _run(runner, tokenizer, tmp_path, [{}, {}, {}])
    finally:
        runner.close()
    results = json.loads((tmp_path / "bad.json").read_text())
    expected = {"unknown model": 404, "messages not a list": 400, "bad role": 400, "negative max_tokens": 400,
                "n=2": 400, "not json": 400, "oversize": 413, "wrong key": 401, "no session": 400,
                "closed session": 404}
    assert {name: status for name, (status, _) in results.items()} == expected
    assert "gpt-4o" in results["unknown model"][1] and "max_tokens" in results["negative max_tokens"][1]
    assert "n=2" in results["n=2"][1] and "wizard" in results["bad role"][1]
    assert all("\n" not in message for _, message in results.values())
    t = batch.tensors
    # Every episode (the one that sent the bad requests too) was served its two good requests, a retry each.
    assert t["agent_loop_errors"].tolist() == [0, 0, 0] and t["agent_requests"].tolist() == [2, 2, 2]
    assert all(len(_turns_of(sampled, row)) == 2 for row in range(3))
    assert (t["response_mask"].sum(-1) > 0).all()


FAILING = '''
import os, time
from openai import OpenAI

def run(episode):
    kind = episode.extra_info["kind"]
    if kind == "raises":
        raise KeyError("the agent broke")
    if kind == "hangs":
        time.sleep(60)
    if kind == "crashes":
        os._exit(3)
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    client.chat.completions.create(model=episode.model, messages=episode.messages, max_tokens=4)
    if kind == "late":
        return None
    return 0.5
'''


def test_failing_agents_fail_only_their_episodes(tmp_path, tokenizer, model_path):
    endpoint = EndpointSettings(num_workers=2, episode_timeout=3.0)
    runner, _ = _runner(tmp_path, model_path, FAILING, endpoint=endpoint)
    kinds = ["raises", "hangs", "ok", "late"]
    try:
        batch = _run(runner, tokenizer, tmp_path, [{"kind": k} for k in kinds])
        # A crash takes the episodes of its process with it (alone here), and the process is replaced.
        crashed = _run(runner, tokenizer, tmp_path, [{"kind": "crashes"}])
        again = _run(runner, tokenizer, tmp_path, [{"kind": "ok"}] * 2)
    finally:
        runner.close()
    t, info = batch.tensors, batch.non_tensors
    assert t["agent_loop_errors"].tolist() == [1, 1, 0, 0]
    assert [info["finish_reason"][i] for i in (0, 1)] == ["error", "timeout"]
    assert [e["agent_reward"] for e in info["extra_info"]] == [None, None, 0.5, None]
    assert t["response_mask"][[0, 1]].sum() == 0 and (t["response_mask"][[2, 3]].sum(-1) > 0).all()
    assert crashed.tensors["agent_loop_errors"].tolist() == [1] and crashed.non_tensors["finish_reason"][0] == "error"
    assert again.tensors["agent_loop_errors"].tolist() == [0, 0]
    # A failed episode without tokens scores 0 and trains nothing; the others are scored (the agent's reward, or
    # the reward function's when it returned None).
    batch.non_tensors["reward_model"] = [{"ground_truth": "x"}] * len(kinds)
    batch.non_tensors["data_source"] = ["t"] * len(kinds)
    scores = compute_token_level_scores(batch, tokenizer, lambda source, text, truth, extra: 0.25)
    assert scores.token_level.sum(-1).tolist() == [0.0, 0.0, 0.5, 0.25]


MORE = '''
import json, os
from openai import OpenAI

def run(episode):
    info = episode.extra_info
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0)
    out = {}
    if info["mode"] == "chat":
        ask = dict(model=episode.model, messages=episode.messages, max_tokens=8, seed=7)
        first = client.chat.completions.create(**ask).choices[0].message.content
        # A retry with a stop string inside what the same seed samples again: the turn ends where it completes.
        stop = first[3:5]
        stopped = client.chat.completions.create(**ask, stop=[stop]).choices[0]
        chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        out = {"first": first, "stop": stop, "stopped": stopped.message.content, "stop_finish": stopped.finish_reason,
               "streamed": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
               "stream_finish": [c.choices[0].finish_reason for c in chunks if c.choices][-1],
               "usage": chunks[-1].usage.completion_tokens}
    elif info["mode"] == "restart":
        ask = dict(model=episode.model, max_tokens=4, seed=3)
        reply = client.chat.completions.create(messages=episode.messages, **ask).choices[0].message
        history = episode.messages + [{"role": "assistant", "content": "my own words"}, {"role": "user", "content": "ok"}]
        client.chat.completions.create(messages=history, **ask)
        out = {"history": history}
    else:
        first = client.completions.create(model=episode.model, prompt="Once upon", max_tokens=4, seed=1, logprobs=0)
        text = "Once upon" + first.choices[0].text + " and then"
        second = client.completions.create(model=episode.model, prompt=text, max_tokens=4, seed=2)
        out = {"first": first.choices[0].text, "logprobs": first.choices[0].logprobs.token_logprobs,
               "text": text, "second": second.choices[0].text}
    with open(os.path.join(info["out"], f"{info['row']}.json"), "w") as f:
        json.dump(out, f)
    return None
'''


def test_retries_stop_strings_streams_restarts_and_completions(tmp_path, tokenizer, model_path):
    runner, sampled = _runner(tmp_path, model_path, MORE)
    try:
        batch = _run(runner, tokenizer, tmp_path, [{"mode": "chat"}, {"mode": "restart"}, {"mode": "completion"}])
    finally:
        runner.close()
    t = batch.tensors
    renderer = TurnRenderer(tokenizer)
    # Chat: three asks of the same turn (retries), the last one streamed; only the last is in the trajectory.
    chat = json.loads((tmp_path / "0.json").read_text())
    first, stopped, streamed = _turns_of(sampled, 0)
    assert first == stopped == streamed  # the same seed at the same positions draws the same tokens
    assert chat["streamed"] == chat["first"] and chat["stream_finish"] == "length" and chat["usage"] == 8
    assert chat["stopped"] == chat["first"][:chat["first"].index(chat["stop"])] and chat["stop_finish"] == "stop"
    responses, mask, _, _ = _response(batch, 0)
    assert responses == streamed and mask == [1] * len(streamed)
    assert t["agent_requests"][0] == 3 and t["agent_divergent_requests"][0] == 0
    # Restart: the client replaced the model's first turn before any other: the trajectory starts again from the
    # new conversation, rendered whole as its prompt, and is flagged.
    restart = json.loads((tmp_path / "1.json").read_text())
    _, second = _turns_of(sampled, 1)
    prompt = t["input_ids"][1, :PROMPT_LEN][t["attention_mask"][1, :PROMPT_LEN].bool()].tolist()
    assert prompt == renderer.prompt_ids(restart["history"]) and _response(batch, 1)[0] == second
    assert t["agent_divergent_requests"][1] == 1
    # Completions: the text prompt extended by the served completion is matched, so only " and then" is new.
    done = json.loads((tmp_path / "2.json").read_text())
    one, two = _turns_of(sampled, 2)
    assert done["text"] == "Once upon" + tokenizer.decode(one, skip_special_tokens=True) + " and then"
    responses, mask, logprobs, sources = _response(batch, 2)
    env = tokenizer(" and then", add_special_tokens=False)["input_ids"]
    assert responses == one + env + two and mask == [1] * len(one) + [0] * len(env) + [1] * len(two)
    assert logprobs[:len(one)] == pytest.approx(done["logprobs"], abs=1e-6)
    prompt = t["input_ids"][2, :PROMPT_LEN][t["attention_mask"][2, :PROMPT_LEN].bool()].tolist()
    assert prompt == tokenizer("Once upon")["input_ids"]


def test_endpoint_keys_reach_the_runner_settings_and_an_open_host_needs_a_key():
    from shardrl.job.errors import ConfigError
    from shardrl.job.load import compose
    from shardrl.job.plan import plan_job
    keys = {"served_model_name": "pol", "port": 8123, "api_key": "k", "max_body_mb": 2, "max_concurrent_requests": 7,
            "episode_timeout": 9.5, "memory_limit_mb": 900, "max_episodes_per_process": 3}
    overrides = ["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.agent.num_workers=3",
                 *(f"actor_rollout_ref.rollout.agent.endpoint.{k}={v}" for k, v in keys.items())]
    rollout = plan_job(compose("ppo_trainer", overrides)).rollout
    endpoint = rollout.agent.endpoint
    assert {k: getattr(endpoint, k) for k in keys} == keys and endpoint.num_workers == 3
    # Multi-turn keeps the prefixes of trajectories whose decode slot was lent out in spare cache rows.
    assert rollout.engine.spare_cache_rows
    assert not plan_job(compose("ppo_trainer", [])).rollout.engine.spare_cache_rows
    assert endpoint.host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"agent.endpoint.host: '0.0.0.0' without agent.endpoint.api_key"):
        plan_job(compose("ppo_trainer", ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                         "actor_rollout_ref.rollout.agent.endpoint.host=0.0.0.0"]))
    plan_job(compose("ppo_trainer", ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                     "actor_rollout_ref.rollout.agent.endpoint.host=0.0.0.0",
                                     "actor_rollout_ref.rollout.agent.endpoint.api_key=secret"]))
