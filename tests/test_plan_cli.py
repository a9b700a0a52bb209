"""The command line: the issue's example runs as written from another directory (so `--config-path=./config` finds
the package's configs), invalid input is one `error:` line on stderr, and a run without the dry run stops before
training with a clear message. Two subprocesses in all; the rest runs `main_ppo.run` in-process."""

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from shardrl.trainer import main_ppo
from shardrl.job.load import CONFIG_DIR
from example_command import EXAMPLE_COMMAND, EXAMPLE_ENV


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **EXAMPLE_ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_issue_example_command_dry_run_from_another_cwd(tmp_path):
    result = shell(EXAMPLE_COMMAND + " trainer.dry_run=true", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "actor: TP4 PP2 DP1, EP4 ETP1 expert-DP1 on 8 GPUs" in result.stdout
    assert "rollout: TP4, 2 replica(s)" in result.stdout
    assert list(tmp_path.iterdir()) == []  # Hydra wrote nothing into the cwd


def test_invalid_input_is_one_error_line_on_stderr(tmp_path):
    result = shell("python3 -m shardrl.trainer.main_ppo --config-path=./config trainer.dry_run=true "
                   "trainer.n_gpus_per_node=6 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4", tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: actor_rollout_ref.actor.megatron: world size 6 is not divisible by "
                                    "TP*CP*PP = 4*1*1")
    assert result.stderr.count("\n") == 1


def raw(overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def test_missing_data_file_fails_at_start_but_not_in_dry_run(tmp_path, capsys):
    missing = tmp_path / "train.parquet"
    assert main_ppo.run(raw([f"data.train_files={missing}", "trainer.dry_run=true"])) == 0
    capsys.readouterr()
    assert main_ppo.run(raw([f"data.train_files={missing}"])) == 2
    assert capsys.readouterr().err == f"error: data.train_files: {missing} does not exist\n"


def test_config_path_resolution(tmp_path):
    package_config = str(CONFIG_DIR)
    resolve = main_ppo.absolute_config_args
    assert resolve(["m", "--config-path=./config"], tmp_path) == ["m", f"--config-path={package_config}"]
    assert resolve(["m", "-cp", "config", "x=1"], tmp_path) == ["m", "-cp", package_config, "x=1"]
    # a directory the package does not have is the user's, relative to the cwd
    assert resolve(["m", "--config-path=mine"], tmp_path) == ["m", f"--config-path={tmp_path / 'mine'}"]
    assert resolve(["m", "--config-path=/abs"], tmp_path) == ["m", "--config-path=/abs"]
