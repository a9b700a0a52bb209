"""Faults in a real run of the default job: SIGKILL then resume reproduces the uninterrupted run's metrics, a
worker that dies mid-step is reported by role and rank with a non-zero exit, fast, and Ctrl-C (SIGINT) ends the run
with its summary and one line, no traceback."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from resume_jobs import command, kill_after_checkpoint, metrics_by_step, wait_for

ARGS = ["trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=1",
        "trainer.total_training_steps=8"]


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    subprocess.run(command(reference, *ARGS), check=True, capture_output=True, timeout=600)
    expected = metrics_by_step(reference)

    killed = tmp_path / "killed"
    k = kill_after_checkpoint(command(killed, *ARGS), killed, 3, 0.0, seed=0)
    assert 3 <= k <= 5, f"killed too late (checkpoint of step {k}); the test needs steps k+1..k+3 <= 8"

    subprocess.run(command(killed, *ARGS), check=True, capture_output=True, timeout=600)
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
    args = command(tmp_path, *ARGS[:-2], "trainer.total_training_steps=100000", "trainer.save_freq=-1")
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


# The synchronous loop, and the fully asynchronous one with its rollout thread and detached pool; SIGTERM (what
# `kill`, Slurm and Kubernetes send) as Ctrl-C.
@pytest.mark.parametrize("config_name, stop, status, line", [
    ("ppo_trainer", signal.SIGINT, 130, "error: interrupted (Ctrl-C or SIGINT)"),
    ("fully_async_ppo_trainer", signal.SIGINT, 130, "error: interrupted (Ctrl-C or SIGINT)"),
    ("ppo_trainer", signal.SIGTERM, 143, "error: terminated (SIGTERM)"),
])
def test_a_stop_signal_ends_the_run_with_its_summary_and_one_line(tmp_path, config_name, stop, status, line):
    run_dir = tmp_path / "run"
    args = command(run_dir, *ARGS[:-2], "trainer.total_training_steps=100000", "trainer.save_freq=2",
                   config_name=config_name)
    args[1:1] = ["-X", "faulthandler"]  # a driver that does not exit dumps its threads' stacks on SIGABRT
    # Output to files, and the driver's own exit awaited: a pipe's end-of-file would also wait for any process
    # that inherited it, which is not what a user at a terminal waits for.
    # SIGINT handled by default in the driver, as at a terminal: a test run started in the background by a
    # non-interactive shell ignores SIGINT, and a child inherits that (then Python installs no handler at all).
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 300, "three steps")
        proc.send_signal(stop)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            pytest.fail(f"the driver did not exit within 60 s of {stop.name}; its stacks:\n"
                        f"{(tmp_path / 'stderr').read_text()[-6000:]}")
        stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
        assert proc.returncode == status and "Traceback" not in stderr, stderr[-2000:]
        assert stderr.strip().splitlines()[-1] == (
            f"{line}; the steps logged so far are kept, and the same command resumes from the last checkpoint "
            f"(trainer.resume_mode=auto)")
        logged = metrics_by_step(run_dir)
        last = max(logged)
        assert re.search(rf"^run interrupted after step {last}$", stdout, re.M), stdout[-2000:]
        assert re.search(rf"^  checkpoint +{run_dir}/global_step_{last - last % 2}$", stdout, re.M), stdout[-2000:]
        assert not (run_dir / "hf_export").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
