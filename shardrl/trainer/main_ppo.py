"""Entry point: ``python -m shardrl.trainer.main_ppo [--config-name=NAME] [key=value ...]`` (verl's command line).

Configs live in `shardrl/job/config/`. A relative ``--config-path`` (verl users pass ``--config-path=./config``)
is looked up in this package first and then in the current directory, whatever the cwd is. With
``trainer.dry_run=true`` the config is validated and the plan printed; invalid input prints one line
``error: <dotted.key>: <reason>`` on stderr and exits 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from shardrl.job.errors import ConfigError
from shardrl.job.load import CONFIG_DIR, load_config
from shardrl.job.plan import format_plan, plan_job
from shardrl.job.preflight import check_launch
from shardrl.rewards.outcomes import RewardFunctionError

PACKAGE_DIR = CONFIG_DIR.parent  # a relative --config-path is looked up here first (`./config`: the packaged ones)
CONFIG_PATH_FLAGS = ("--config-path", "-cp")


def run(cfg: DictConfig) -> int:
    """Validate, plan, and (dry run) print the plan; returns the exit status."""
    try:
        config = load_config(cfg)
        plan = plan_job(config)
        if plan.dry_run:
            print(format_plan(plan, config))
            return 0
        check_launch(plan)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from shardrl.trainer.launch import train  # heavy imports (Ray, models) only when training starts

    try:
        train(plan)
    except ConfigError as err:  # found while loading data and tokenizers, before any worker starts
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RewardFunctionError as err:  # the user's reward function failed a sample (custom_reward_function.on_error)
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def resolve_config_path(path: str, cwd: Path) -> str:
    """A relative config dir: this package's own (``./config``) if it exists there, else relative to `cwd`."""
    if "://" in path or Path(path).is_absolute():
        return path
    in_package = PACKAGE_DIR / path
    return str(in_package.resolve() if in_package.is_dir() else (cwd / path).resolve())


def absolute_config_args(argv: list[str], cwd: Path) -> list[str]:
    """`argv` with every ``--config-path``/``-cp`` value made absolute (``--flag=value`` and ``--flag value``)."""
    out = list(argv)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag not in CONFIG_PATH_FLAGS:
            continue
        if eq:
            out[i] = f"{flag}={resolve_config_path(value, cwd)}"
        elif i + 1 < len(out):
            out[i + 1] = resolve_config_path(out[i + 1], cwd)
    return out


@hydra.main(config_path=str(CONFIG_DIR), config_name="ppo_trainer", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    sys.exit(run(cfg))


def main() -> None:
    sys.argv = absolute_config_args(sys.argv, Path.cwd())
    _hydra_main()


if __name__ == "__main__":
    main()
