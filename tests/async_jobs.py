"""Shared by the async end-to-end tests: run the trainer's CLI on the default job and read what it logged."""

import json
import math
import subprocess
import sys

# A trainer pool of 2 ranks at TP2: a rollout pool of 1 rank could not hold the trainer's layout.
DETACHED = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]


def run_job(run_dir, config_name, *overrides, timeout=600):
    """`python -m shardrl.trainer.main_ppo --config-name=...` -> (metrics.jsonl rows, stdout)."""
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"--config-name={config_name}",
           f"trainer.default_local_dir={run_dir}", "trainer.logger=[file]", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, done.stdout


def check_learned(rows, bound):
    """Validation reward from < 0.3 to >= 0.9; samples were off-policy but never past `bound` versions."""
    val = [(r["step"], r["val-core/reward/mean"]) for r in rows if "val-core/reward/mean" in r]
    assert val[0][1] < 0.3 and val[-1][1] >= 0.9, val
    lags = [r["async/staleness_max"] for r in rows if "async/staleness_max" in r]
    assert 1 <= max(lags) <= bound, lags
    for r in rows:
        if "async/staleness_hist" in r:
            assert math.isclose(sum(r["async/staleness_hist"]), 1.0), r["async/staleness_hist"]


def assert_same_numbers(expected_rows, rows, not_compared):
    """Every logged number of `expected_rows` (keys not starting with one of `not_compared`) equal in `rows`, step
    by step."""
    assert [r["step"] for r in expected_rows] == [r["step"] for r in rows]
    for expected, got in zip(expected_rows, rows):
        keys = {k for k in expected if not k.startswith(not_compared)}
        assert keys <= set(got), sorted(keys - set(got))
        assert {k: got[k] for k in keys} == {k: expected[k] for k in keys}, f"step {expected['step']}"
