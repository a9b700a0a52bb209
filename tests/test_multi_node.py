"""Two Ray nodes on one machine (`ray start --head` plus a second node with its own core, on another loopback
address, as a second machine would have its own), the default job joining them through `ray_kwargs.ray_init.address`:
the detached mode with its trainer pool on one node and its rollout pool on the other, and a sync job whose trainer
spans both. On a cluster of the user's own a CPU rank reserves a whole core, so each one-core node holds one rank
and the pools must spread; the rendezvous address is rank 0's node as Ray reports it (here not the head's), never
localhost. Slow (a cluster and two jobs), and run by .ci/run after the default suite."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RAY = Path(sys.executable).parent / "ray"
SECOND_NODE_IP = "127.0.0.2"  # Linux routes all of 127/8 to loopback: an address of its own for the second raylet
QUICK = ["trainer.logger=[file]", "trainer.total_training_steps=2", "trainer.test_freq=-1",
         "trainer.val_before_train=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_cluster(temp_dir: str, port: int) -> None:
    """SIGKILL every process of this cluster (its command lines name its temp dir or its GCS port); `ray stop`
    would take every Ray instance on the machine with it."""
    marks = (temp_dir.encode(), f":{port}".encode(), f"_port={port}".encode())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if any(mark in cmdline for mark in marks):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


@pytest.fixture(scope="module")
def cluster():
    """The head (this machine's address, one core) and a second node (127.0.0.2, one core); yields the address."""
    temp_dir = tempfile.mkdtemp(prefix="srl_mn_", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    address = f"127.0.0.1:{port}"
    try:
        subprocess.run([str(RAY), "start", "--head", f"--port={port}", "--num-cpus=1", f"--temp-dir={temp_dir}",
                        "--include-dashboard=false", "--disable-usage-stats"],
                       check=True, capture_output=True, env=env, timeout=120)
        subprocess.run([str(RAY), "start", f"--address={address}", "--num-cpus=1",
                        f"--node-ip-address={SECOND_NODE_IP}"], check=True, capture_output=True, env=env, timeout=120)
        yield address, env
    finally:
        _kill_cluster(temp_dir, port)
        time.sleep(1)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _run(run_dir: Path, address: str, env: dict, *overrides: str,
         config_name: str = "ppo_trainer") -> tuple[str, list[str]]:
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"--config-name={config_name}",
           f"trainer.default_local_dir={run_dir}", *QUICK,
           f"+ray_kwargs.ray_init.address={address}", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    placement = next(line for line in done.stdout.splitlines() if line.startswith("placement: "))
    return placement, (run_dir / "metrics.jsonl").read_text().splitlines()


def test_detached_pools_on_two_nodes(cluster, tmp_path):
    address, env = cluster
    placement, rows = _run(tmp_path, address, env, "trainer.n_gpus_per_node=1",
                           config_name="one_step_off_ppo_trainer")
    found = re.fullmatch(r"placement: trainer pool rank 0 on (\S+); rollout pool rank 1 on (\S+)", placement)
    assert found and found[1] != found[2] and SECOND_NODE_IP in found.groups(), placement
    assert len(rows) == 2


def test_a_sync_job_whose_trainer_spans_both_nodes(cluster, tmp_path):
    address, env = cluster
    placement, rows = _run(tmp_path, address, env, "trainer.nnodes=2", "trainer.n_gpus_per_node=1")
    found = re.fullmatch(r"placement: trainer pool rank 0 on (\S+), rank 1 on (\S+)", placement)
    assert found and found[1] != found[2] and SECOND_NODE_IP in found.groups(), placement
    assert len(rows) == 2
