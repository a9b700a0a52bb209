"""Entry point: ``python -m shardrl.trainer.main_ppo [--config-name=NAME] [key=value ...]`` (verl's command line).

Configs live in `shardrl/job/config/`. A relative ``--config-path`` (verl users pass ``--config-path=./config``)
is looked up in this package first and then in the current directory, whatever the cwd is. With
``trainer.dry_run=true`` the config is validated and the plan printed. ``--help`` lists the configs and the most used
keys (`command_line`); a ``key=value`` whose key does not exist fails before Hydra composes, naming the closest. A failure the user can fix (`UserError`: a
config key, a data or model file, a reward function or tool of theirs, also when a worker raised it) prints one line
``error: <key or file>: <reason>`` on stderr and exits 2; any other failure one line and exit 1; Ctrl-C (SIGINT) stops
the workers, prints where the run stands and exits 130; SIGTERM (`kill`, Slurm, Kubernetes) does the same and exits
143. ``SHARDRL_DEBUG=1`` adds the traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra._internal.utils import get_args_parser
from omegaconf import DictConfig

from shardrl.errors import DEBUG_ENV, UserError, first_line
from shardrl.job.load import CONFIG_DIR, load_config
from shardrl.job.plan import format_plan, plan_job
from shardrl.job.preflight import check_launch
from shardrl.trainer.command_line import DEFAULT_CONFIG, add_or_override, check_overrides, help_text
from shardrl.trainer.stop_signals import stopped_by_sigterm

PACKAGE_DIR = CONFIG_DIR.parent  # a relative --config-path is looked up here first (`./config`: the packaged ones)
CONFIG_PATH_FLAGS = ("--config-path", "-cp")
INTERRUPTED_STATUS = 130  # the shell's status for a program ended by SIGINT
TERMINATED_STATUS = 143  # and by SIGTERM
RESUME_HINT = "the steps logged so far are kept, and the same command resumes from the last checkpoint " \
              "(trainer.resume_mode=auto)"


def run(cfg: DictConfig) -> int:
    """Validate, plan, and (dry run) print the plan or train; returns the exit status (see the module's doc)."""
    try:
        config = load_config(cfg)
        plan = plan_job(config)
        if plan.dry_run:
            print(format_plan(plan, config))
            return 0
        check_launch(plan)
        local_cluster_auth(plan.cluster.ray_init.get("address"))
        from shardrl.trainer.launch import train  # heavy imports (Ray, models) only when training starts

        train(plan)
    except UserError as err:
        return _report(err, 2)
    except KeyboardInterrupt:
        if stopped_by_sigterm():
            print(f"error: terminated (SIGTERM); {RESUME_HINT}", file=sys.stderr)
            return TERMINATED_STATUS
        print(f"error: interrupted (Ctrl-C or SIGINT); {RESUME_HINT}", file=sys.stderr)
        return INTERRUPTED_STATUS
    except Exception as err:
        from shardrl.controller.group import WorkerError  # loaded already when a worker failed

        if isinstance(err, WorkerError):  # its message names the role, rank, node and what the rank raised
            return _report(err, 2 if err.user_error else 1)
        return _report(err, 1, f"internal error, {type(err).__name__}: ",
                       f" (a shardrl bug: {DEBUG_ENV}=1 prints the traceback to report)")
    return 0


def local_cluster_auth(address: str | None) -> None:
    """A local Ray cluster (no `ray_kwargs.ray_init.address`) gets token authentication, Ray's default for a new
    one, asked for explicitly, so that Ray does not warn that it chose it (a cluster of the user's keeps its own
    mode). Called before Ray is imported: Ray reads the mode once, at import."""
    if not address:
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def _report(err: Exception, status: int, prefix: str = "", suffix: str = "") -> int:
    """Print `err` as one `error:` line on stderr (and re-raise it for the traceback under SHARDRL_DEBUG=1)."""
    if os.environ.get(DEBUG_ENV) == "1":
        raise err
    print(f"error: {prefix}{first_line(err)}{suffix}", file=sys.stderr)
    return status


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


@hydra.main(config_path=str(CONFIG_DIR), config_name=DEFAULT_CONFIG, version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    sys.exit(run(cfg))


def main() -> None:
    sys.argv = absolute_config_args(sys.argv, Path.cwd())
    # Hydra's own parser, so flags and overrides are read as Hydra reads them; its stock --help (a yaml dump) is
    # replaced, and an unknown key fails here with the closest one instead of Hydra's bare "not in struct".
    args = get_args_parser().parse_args(sys.argv[1:])
    config_dir, config_name = args.config_path or str(CONFIG_DIR), args.config_name or DEFAULT_CONFIG
    rewritten = dict(zip(args.overrides, add_or_override(args.overrides, config_dir, config_name)))
    sys.argv = [sys.argv[0], *(rewritten.get(arg, arg) for arg in sys.argv[1:])]
    try:
        check_overrides(args.overrides, args.config_path or str(CONFIG_DIR), args.config_name or DEFAULT_CONFIG)
        if args.help:
            print(help_text(args.config_path or str(CONFIG_DIR), args.config_name or DEFAULT_CONFIG))
            sys.exit(0)
    except UserError as err:
        sys.exit(_report(err, 2))
    _hydra_main()


if __name__ == "__main__":
    main()
