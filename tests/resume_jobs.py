"""Shared by the SIGKILL-then-resume tests: run the trainer's CLI, kill the whole job at a random point after a
checkpoint, run it again and read each step's last logged record."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

# Metrics that measure time or where the rollout pool stood when the trainer looked (its queue at a take, its engine
# steps since the last step): they differ between two uninterrupted runs too.
TIMING = ("timing_s/", "perf/throughput", "sync/seconds", "sync/gbps", "rollout/", "async/queue_groups",
          "async/running_groups")


def command(run_dir: Path, *overrides: str, config_name: str = "ppo_trainer") -> list[str]:
    return [sys.executable, "-m", "shardrl.trainer.main_ppo", f"--config-name={config_name}",
            f"trainer.default_local_dir={run_dir}", "trainer.logger=[file]", *overrides]


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """Each step's record, without the TIMING metrics. The steps strictly increase: a run resumed in its own
    directory continues its metrics file without the rows the killed run logged after the checkpoint."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), steps
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows}


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def latest_step(run_dir: Path) -> int:
    latest = run_dir / "latest"
    return int(latest.read_text().strip().rsplit("_", 1)[-1]) if latest.exists() else 0


def kill_after_checkpoint(args: list[str], run_dir: Path, step: int, within_s: float, seed: int) -> int:
    """Start the job, SIGKILL its process group at a random moment within `within_s` seconds after the checkpoint of
    `step` (the driver; its Ray workers, in groups of their own, follow: they watch the driver,
    tests/test_driver_watch.py); the latest checkpoint's step."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: latest_step(run_dir) >= step or proc.poll() is not None, 300, f"the step-{step} checkpoint")
        time.sleep(random.Random(seed).uniform(0.0, within_s))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return latest_step(run_dir)
