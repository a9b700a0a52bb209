"""The default job's maths, bit for bit: a refactor proves it changed no maths by leaving every maths metric of
`python -m shardrl.trainer.main_ppo` (4 GRPO steps on CPU, validation at steps 0, 2 and 4) exactly as committed in
tests/baselines/default_job_metrics.json. Losses, rewards and scores, advantages, returns, grad norm, lr, KL,
entropy, clip fractions, lengths, rollout_corr/* and every other logged key are compared as the exact bits of their
double; only the keys under NOT_MATHS (wall-clock, throughput, weight-sync transport) are left out.

A deliberate maths change updates the baseline in the same commit, and the commit message says why the numbers moved:
`SHARDRL_UPDATE_BASELINE=1 .venv/bin/python -m pytest tests/test_metric_baseline.py` rewrites the file and skips;
review its diff like code.

The bits hold for one torch build on one kind of CPU (every CPU rank runs one thread, so the core count does not
matter, but the vector ISA and the processor model pick torch's kernels): the file records all three, and a failure
names them beside this machine's. On another build, ISA or processor (an AVX2 machine against an AVX512 baseline, an
AMD EPYC against an Intel one) the kernels round differently, so numbers are compared up to that rounding instead
(relative 1e-4, absolute 1e-7: float32 rounding carried through four steps, far below what a changed formula moves);
counts, steps and keys still exactly.
"""

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BASELINE = Path(__file__).parent / "baselines" / "default_job_metrics.json"
UPDATE_ENV = "SHARDRL_UPDATE_BASELINE"
OVERRIDES = ["trainer.device=cpu", "trainer.total_training_steps=4", "trainer.test_freq=2"]
# Not maths, by key prefix. Any other key is compared, and a new one fails until it is in the baseline or here.
NOT_MATHS = (
    "timing_s/",  # wall-clock seconds of each phase and step
    "perf/throughput",  # tokens per wall-clock second (perf/total_num_tokens, a count, is compared)
    # Weight-sync transport: seconds and GB/s are wall-clock, peak_extra_bytes is memory, and bytes, buckets and copy
    # launches say how the weights travelled, not what they are (each sync's checksum verifies those).
    "sync/",
)


def run_default_job(run_dir: Path) -> list[dict]:
    """The default job's logged rows, less the keys under NOT_MATHS."""
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={run_dir}",
           "trainer.logger=[file]", *OVERRIDES]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in row.items() if not key.startswith(NOT_MATHS)} for row in rows]


def made_with() -> dict[str, str]:
    return {"torch": torch.__version__, "cpu": f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}",
            "cpu_model": cpu_model()}


def cpu_model() -> str:
    """The processor's name: CPUs of one vector ISA still pick different kernels by vendor and model (an AMD EPYC
    and an Intel Xeon, both AVX512, round the same job differently)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown"


def bits(value):
    """A metric as its exact bits: a number as the hex of its double (telling -0.0 from 0.0, NaN equal to NaN)."""
    if isinstance(value, list):
        return [bits(v) for v in value]
    return float(value).hex() if isinstance(value, (int, float)) else value


def close(want, have) -> bool:
    """Equal up to another CPU's float32 rounding (see the module docstring)."""
    if isinstance(want, list) and isinstance(have, list):
        return len(want) == len(have) and all(close(w, h) for w, h in zip(want, have))
    if isinstance(want, (int, float)) and isinstance(have, (int, float)):
        return math.isclose(want, have, rel_tol=1e-4, abs_tol=1e-7) or bits(want) == bits(have)
    return want == have


def differences(expected: list[dict], got: list[dict], exact: bool = True) -> list[str]:
    """Each way `got` departs from `expected` (bit for bit, or `close` when not `exact`), step by step and in the
    order a step logs its keys."""
    same = (lambda w, h: bits(w) == bits(h)) if exact else close
    steps, baseline_steps = [row["step"] for row in got], [row["step"] for row in expected]
    if steps != baseline_steps:
        return [f"logged steps {steps}, baseline steps {baseline_steps}"]
    found = []
    for want, have in zip(expected, got):
        step = want["step"]
        if missing := sorted(want.keys() - have.keys()):
            found.append(f"step {step}: baseline metrics not logged: {missing}")
        if new := sorted(have.keys() - want.keys()):
            found.append(f"step {step}: metrics not in the baseline: {new} (if not maths, add a NOT_MATHS prefix)")
        found += [f"step {step} {key}: expected {want[key]!r}, got {have[key]!r}"
                  for key in want if key in have and not same(want[key], have[key])]
    return found


def test_default_job_matches_metric_baseline(tmp_path):
    rows = run_default_job(tmp_path)
    if os.environ.get(UPDATE_ENV) == "1":
        BASELINE.parent.mkdir(exist_ok=True)
        baseline = {"overrides": OVERRIDES, "made_with": made_with(), "rows": rows}
        BASELINE.write_text(json.dumps(baseline, indent=1) + "\n")
        pytest.skip(f"{UPDATE_ENV}=1: rewrote {BASELINE.name} ({len(rows)} rows); commit it with the reason")
    baseline = json.loads(BASELINE.read_text())
    assert baseline["overrides"] == OVERRIDES, (
        f"{BASELINE.name} was made with {baseline['overrides']}, the test runs {OVERRIDES}: rerun with {UPDATE_ENV}=1")
    exact = baseline["made_with"] == made_with()
    if found := differences(baseline["rows"], rows, exact):
        how = "bit for bit" if exact else "up to another CPU's rounding"
        pytest.fail(f"the default job's maths moved ({how}): {len(found)} differences from {BASELINE.name}, first: "
                    f"{found[0]}\n"
                    f"baseline made with {baseline['made_with']}, this run with {made_with()}; a deliberate maths "
                    f"change reruns with {UPDATE_ENV}=1 and says why in the commit\n" + "\n".join(found[1:20]),
                    pytrace=False)
