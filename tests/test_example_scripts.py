"""The example scripts run with the project's environment by default: each sources examples/python_env.sh, which
picks the repository's .venv when there is one (else python3) and leaves a PYTHON the user set alone."""

import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SOURCE_LINE = 'source "$(dirname "${BASH_SOURCE[0]}")/../python_env.sh"'


@pytest.mark.parametrize("script", sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.glob("*/*.sh")))
def test_every_example_script_that_runs_python_takes_it_from_python_env(script):
    text = (EXAMPLES / script).read_text()
    assert "$PYTHON" not in text or SOURCE_LINE in text
    assert "PYTHON=${PYTHON:-" not in text


def python_of(repo: Path, env: dict[str, str]) -> str:
    """PYTHON after the scripts' preamble, in a copy of the examples under `repo`."""
    command = f'{SOURCE_LINE} && echo "$PYTHON"'
    return subprocess.run(["bash", "-c", command.replace("${BASH_SOURCE[0]}", str(repo / "examples" / "x" / "x.sh"))],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_python_env_prefers_the_repository_venv_and_keeps_a_set_python(tmp_path):
    (tmp_path / "examples" / "x").mkdir(parents=True)
    shutil.copy(EXAMPLES / "python_env.sh", tmp_path / "examples")
    path = {"PATH": "/usr/bin:/bin"}
    assert python_of(tmp_path, path) == "python3"
    venv_python = tmp_path / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("#!/bin/sh\n")
    venv_python.chmod(0o755)
    assert python_of(tmp_path, path) == str(venv_python)
    assert python_of(tmp_path, {**path, "PYTHON": "/opt/py/bin/python"}) == "/opt/py/bin/python"
