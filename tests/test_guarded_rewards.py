"""Reward functions run out of the trainer's process: GuardedScoreFn against real child processes, HttpRewardClient
against a real HTTP server in a thread. Each failure a reward function can have is tried, in both on_error modes."""

from __future__ import annotations

import contextlib
import importlib.util
import http.server
import json
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from process_checks import processes_mentioning

from shardrl.rewards.guarded import GuardedScoreFn
from shardrl.rewards.http_reward import HttpRewardClient
from shardrl.rewards.outcomes import BatchScores, RewardFunctionError

pytestmark = pytest.mark.timeout(60)

MakeScorer = Callable[..., GuardedScoreFn]

SOURCE = """
    import asyncio

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "raise":
            raise ValueError(f"cannot parse {solution_str!r}")
        if solution_str == "hang":
            while True:
                pass
        if solution_str == "text":
            return "yes"
        if solution_str == "dict":
            return {"score": 1, "acc": True, "pred": [ground_truth]}
        weight = sum(extra_info["weights"])
        return weight * float(solution_str.strip() == str(ground_truth))

    async def async_compute_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return compute_score(data_source, solution_str, ground_truth, extra_info)
"""


def sample(solution: str, answer: Any = np.int64(4), source: str = "gsm8k") -> tuple[str, str, Any, dict[str, Any]]:
    """A sample as parquet rows give them: numpy values in ground_truth and extra_info."""
    return source, solution, answer, {"weights": np.array([0.5, 1.5]), "index": np.int64(3)}


@pytest.fixture
def make_scorer(tmp_path: Path) -> Iterator[MakeScorer]:
    """GuardedScoreFn on `name` of SOURCE (or `source`) written as tmp_path/reward.py; all closed afterwards."""
    with contextlib.ExitStack() as scorers:
        def make(name: str = "compute_score", source: str = SOURCE, **options: Any) -> GuardedScoreFn:
            (tmp_path / "reward.py").write_text(textwrap.dedent(source))
            options = {"num_workers": 2, "timeout": 30.0, "on_error": "fail"} | options
            return scorers.enter_context(GuardedScoreFn(str(tmp_path / "reward.py"), name, **options))
        yield make


@pytest.mark.parametrize("name", ["compute_score", "async_compute_score"])
def test_scores_are_those_of_the_function_called_in_process(make_scorer: MakeScorer, tmp_path: Path,
                                                            name: str) -> None:
    batch = [sample("4"), sample(" 4\n"), sample("5"), sample("7", np.int64(7), "other"), sample("dict")]
    scores = make_scorer(name).score_batch(batch)
    spec = importlib.util.spec_from_file_location("in_process_reward", tmp_path / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    in_process = module.compute_score
    expected = [in_process(*s) for s in batch]
    assert scores == BatchScores(expected, [None] * 5)
    assert scores.scores[:4] == [2.0, 2.0, 0.0, 2.0] and type(scores.scores[0]) is float
    assert scores.scores[4] == {"score": 1.0, "acc": True, "pred": [4]}  # extras pass through


def test_a_function_that_never_returns_times_out_and_close_ends_it(make_scorer: MakeScorer, tmp_path: Path) -> None:
    scorer = make_scorer(timeout=0.5, on_error="fail")
    with pytest.raises(RewardFunctionError) as info:
        scorer.score_batch([sample("4"), sample("hang")])
    assert str(info.value) == (f"reward function {tmp_path}/reward.py:compute_score failed on sample 1 "
                               f"(data_source 'gsm8k'): timed out after 0.5 s")
    scorer.close()  # its thread spins on in a worker: close kills the workers anyway
    assert processes_mentioning(str(tmp_path)) == []


def test_with_on_error_zero_a_failed_sample_scores_0_and_says_why(make_scorer: MakeScorer) -> None:
    scores = make_scorer(timeout=0.5, on_error="zero").score_batch(
        [sample("hang"), sample("raise"), sample("text"), sample("4")])
    assert scores.scores == [0.0, 0.0, 0.0, 2.0]
    hang, raised, text, good = scores.errors
    assert hang.endswith("failed on sample 0 (data_source 'gsm8k'): timed out after 0.5 s")
    assert raised.endswith("failed on sample 1 (data_source 'gsm8k'): ValueError: cannot parse 'raise'")
    assert text.endswith("failed on sample 2 (data_source 'gsm8k'): returned str 'yes'; it must return a finite "
                         "number or a dict with a numeric 'score'")
    assert good is None


@pytest.mark.parametrize("returned, what", [
    ("'yes'", "returned str 'yes'"), ("True", "returned bool True"), ("float('nan')", "returned float nan"),
    ("float('inf')", "returned float inf"), ("{'acc': 1.0}", "returned a dict without 'score' (keys ['acc'])"),
    ("{'score': '1'}", "returned a dict whose 'score' is str '1'"), ("{1, 2}", "returned set {1, 2}"),
])
def test_a_value_that_is_no_score_fails_naming_its_type(make_scorer: MakeScorer, tmp_path: Path, returned: str,
                                                        what: str) -> None:
    scorer = make_scorer(source=f"def compute_score(*args):\n    return {returned}\n")
    with pytest.raises(RewardFunctionError) as info:
        scorer.score_batch([sample("4")])
    message = str(info.value)
    assert message.startswith(f"reward function {tmp_path}/reward.py:compute_score failed on sample 0 "
                              f"(data_source 'gsm8k'): ") and what in message and "\n" not in message, message


def test_a_crash_fails_its_sample_and_the_workers_recover(make_scorer: MakeScorer) -> None:
    scorer = make_scorer(source="import os\n\ndef compute_score(ds, text, *rest):\n"
                                "    return os._exit(3) if text == 'crash' else 1.0\n", on_error="zero")
    crashed = scorer.score_batch([sample("crash")])
    assert "reward process died (exit code 3)" in crashed.errors[0]
    assert scorer.score_batch([sample("4"), sample("5")]) == BatchScores([1.0, 1.0], [None, None])


def test_a_function_that_cannot_load_is_refused_at_once(tmp_path: Path) -> None:
    (tmp_path / "reward.py").write_text("def other(*args):\n    return 1.0\n")
    with pytest.raises(RewardFunctionError, match=f"^cannot load reward function {tmp_path}/reward.py:"
                                                  f"compute_score: .* has no attribute 'compute_score'$"):
        GuardedScoreFn(str(tmp_path / "reward.py"), "compute_score", num_workers=1, timeout=5, on_error="fail")
    assert processes_mentioning(str(tmp_path)) == []


def test_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    reward = str(tmp_path / "reward.py")  # never written: nothing is loaded
    with pytest.raises(ValueError, match="^on_error must be 'fail' or 'zero', got 'skip'$"):
        GuardedScoreFn(reward, "compute_score", num_workers=1, timeout=1, on_error="skip")
    with pytest.raises(ValueError, match="^GuardedScoreFn num_workers must be positive, got 0$"):
        GuardedScoreFn(reward, "compute_score", num_workers=0, timeout=1, on_error="fail")
    with pytest.raises(ValueError, match="^HttpRewardClient retries and backoff must be >= 0, got -1 and 0.1$"):
        HttpRewardClient("http://127.0.0.1:9", max_concurrency=1, timeout=1, retries=-1, backoff=0.1)


class RewardServer:
    """A JSON reward server in a thread: it answers each request with the next of `answers`, (status, JSON body),
    or with none ever when that is None; `requests` holds the bodies it was sent."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, Any] | None] = []
        self.requests: list[dict[str, Any]] = []
        self.release = threading.Event()  # lets the handlers that never answer end, at teardown
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                server.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                answer = server.answers.pop(0)
                if answer is None:
                    server.release.wait()
                    return
                body = json.dumps(answer[1]).encode()
                self.send_response(answer[0])
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/score"
        threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server() -> Iterator[RewardServer]:
    running = RewardServer()
    yield running
    running.close()


def client(server: RewardServer, **options: Any) -> HttpRewardClient:
    return HttpRewardClient(server.url, **{"max_concurrency": 4, "timeout": 5.0, "retries": 2, "backoff": 0.01,
                                           "on_error": "fail"} | options)


def test_http_scores_each_sample_and_retries_a_5xx(server: RewardServer) -> None:
    server.answers = [(500, "busy"), (200, {"score": 1, "acc": False}), (503, "busy"), (200, 0.5)]
    scores = client(server, max_concurrency=1).score_batch([sample("4"), sample("5", "five", "math")])
    assert scores == BatchScores([{"score": 1.0, "acc": False}, 0.5], [None, None])
    assert server.requests[1] == {"data_source": "gsm8k", "solution_str": "4", "ground_truth": 4,
                                  "extra_info": {"weights": [0.5, 1.5], "index": 3}}
    assert len(server.requests) == 4 and server.requests[3]["ground_truth"] == "five"


def test_http_refuses_a_4xx_at_once(server: RewardServer) -> None:
    server.answers = [(422, "bad sample"), (200, 1.0)]
    with pytest.raises(RewardFunctionError) as info:
        client(server).score_batch([sample("4")])
    assert str(info.value) == (f"reward server {server.url} failed on sample 0 (data_source 'gsm8k'): "
                               f"HTTP 422 Unprocessable Entity")
    assert len(server.requests) == 1


def test_http_gives_up_after_its_retries(server: RewardServer) -> None:
    server.answers = [(500, "down")] * 3
    scores = client(server, on_error="zero").score_batch([sample("4")])
    assert scores.scores == [0.0]
    assert scores.errors[0].endswith("HTTP 500 Internal Server Error (after 3 attempts)")


def test_http_a_server_that_never_answers_times_out(server: RewardServer) -> None:
    server.answers = [None, None]
    scores = client(server, timeout=0.3, retries=1, on_error="zero").score_batch([sample("4")])
    assert scores.scores == [0.0] and scores.errors[0] == (f"reward server {server.url} failed on sample 0 "
                                                            f"(data_source 'gsm8k'): timed out after 0.3 s "
                                                            f"(after 2 attempts)")


def test_http_an_answer_that_is_no_score_is_refused(server: RewardServer) -> None:
    server.answers = [(200, "1.0")]
    with pytest.raises(RewardFunctionError, match=r"failed on sample 0 \(data_source 'gsm8k'\): returned str '1.0'"):
        client(server).score_batch([sample("4")])


def test_http_a_server_that_is_not_there_is_unreachable(server: RewardServer) -> None:
    url = server.url
    server.close()
    scores = HttpRewardClient(url, max_concurrency=1, timeout=1.0, retries=0, backoff=0.0,
                              on_error="zero").score_batch([sample("4")])
    assert "failed on sample 0 (data_source 'gsm8k'): unreachable (ConnectionRefusedError" in scores.errors[0]
