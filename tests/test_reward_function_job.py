"""A custom reward function that hangs cannot hang or crash the trainer: it runs in
processes of its own; with `on_error=fail` the run ends within the per-sample timeout with one line naming the
function and the sample, with `on_error=zero` it goes on, the failures scored 0 and counted."""

import json
import subprocess
import sys

import pytest

BAD_REWARD = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("3"):
        time.sleep(3600)
    return 1.0
'''


def run(tmp_path, *overrides):
    reward = tmp_path / "hanging_reward.py"
    reward.write_text(BAD_REWARD)
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={tmp_path / 'run'}",
           "trainer.logger=[file]", f"custom_reward_function.path={reward}", "custom_reward_function.timeout=3",
           "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300), reward


def test_a_hanging_reward_function_ends_the_run_with_one_line_within_its_timeout(tmp_path):
    """(Raising and non-number returns take the same path: tests/test_guarded_rewards.py.)"""
    done, reward = run(tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"loaded reward function {reward.resolve()}:compute_score" in done.stdout.splitlines()
    last = done.stderr.strip().splitlines()[-1]
    assert f"reward function {reward}:compute_score failed on sample" in last and "timed out after 3 s" in last, last


@pytest.mark.slow  # the policy itself: tests/test_guarded_rewards.py
def test_with_on_error_zero_the_run_goes_on_and_counts_them(tmp_path):
    done, _ = run(tmp_path, "custom_reward_function.on_error=zero")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    failed = [r["reward_extra/reward_failed/mean"] for r in rows if "reward_extra/reward_failed/mean" in r]
    assert len(failed) == 1 and all(0 < f < 1 for f in failed)  # the samples answering "3..." hung


def test_a_reward_service_scores_every_sample_and_a_busy_answer_is_retried(tmp_path):
    import http.server
    import threading

    received = []

    class Scores(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            sample = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(sample)
            busy = len(received) == 1  # the first request: "busy", retried
            body = json.dumps({"score": 0.25, "length": len(sample["solution_str"])}).encode()
            self.send_response(503 if busy else 200)
            self.send_header("Content-Length", str(0 if busy else len(body)))
            self.end_headers()
            if not busy:
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Scores)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={tmp_path / 'run'}",
               "trainer.logger=[file]", f"custom_reward_function.url=http://127.0.0.1:{server.server_port}/score",
               "custom_reward_function.retry_backoff=0.1", "trainer.total_training_steps=1", "trainer.test_freq=-1",
               "trainer.val_before_train=false"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["critic/score/mean"] == 0.25 and "reward_extra/length/mean" in rows[-1]
    assert len(received) == 256 + 1  # 32 prompts x rollout.n 8, the first one twice
    assert set(received[0]) == {"data_source", "solution_str", "ground_truth", "extra_info"}


def test_fully_async_a_hanging_reward_function_on_the_scoring_thread_ends_the_run_with_one_line(tmp_path):
    """The rollouter scores each finished group on a thread of its own: its failure still reaches the trainer as
    the same one line."""
    done, reward = run(tmp_path, "reward_model.use_reward_loop=true", "--config-name=fully_async_ppo_trainer")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"reward function {reward}:compute_score failed on sample" in last and "timed out after 3 s" in last, last
