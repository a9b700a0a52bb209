"""Faults in a real run of the default job: SIGKILL then resume reproduces the uninterrupted run's metrics, and a
worker that dies mid-step is reported by role and rank with a non-zero exit, fast."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ARGS = ["trainer.logger=[file]", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=1",
        "trainer.total_training_steps=8"]
TIMING = ("timing_s/", "perf/throughput", "sync/seconds", "sync/gbps")


def command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={run_dir}", *ARGS]


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """The last record of each step (a killed run may have logged a step it then repeated after resuming)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows}


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def latest_step(run_dir: Path) -> int:
    latest = run_dir / "latest"
    return int(latest.read_text().strip().rsplit("_", 1)[-1]) if latest.exists() else 0


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    subprocess.run(command(reference), check=True, capture_output=True, timeout=600)
    expected = metrics_by_step(reference)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_for(lambda: latest_step(killed) >= 3 or proc.poll() is not None, 300, "the step-3 checkpoint")
    os.killpg(proc.pid, signal.SIGKILL)  # the driver's process group; its workers, in groups of their own, follow
    # (they see the Ray daemons go, and watch the driver: tests/test_driver_watch.py)
    proc.wait()
    k = latest_step(killed)
    assert 3 <= k <= 5, f"killed too late (checkpoint of step {k}); the test needs steps k+1..k+3 <= 8"

    subprocess.run(command(killed), check=True, capture_output=True, timeout=600)
    resumed = metrics_by_step(killed)
    for step in (k + 1, k + 2, k + 3):
        assert resumed[step] == expected[step], f"step {step} differs after resuming from step {k}"


def _actor_worker_pids(session_id: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            sid = os.getsid(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
        if sid == session_id and cmdline.startswith("ray::RankHost"):
            pids.append(int(entry.name))
    return pids


def test_dead_worker_is_named_and_the_trainer_exits(tmp_path):
    args = command(tmp_path)[:-1] + ["trainer.total_training_steps=100000", "trainer.save_freq=-1"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        metrics = tmp_path / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 300, "two steps")
        pids = _actor_worker_pids(proc.pid)
        assert pids, "no Ray worker process found"
        killed_at = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
        assert proc.returncode == 1 and "Traceback" not in stderr, stderr[-2000:]
        # One line naming the role, the rank, its node and the cause.
        assert re.search(r"^error: worker group .*role 'actor'.*rank 0 on [\w.:-]+ died", stderr, re.M), stderr[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
