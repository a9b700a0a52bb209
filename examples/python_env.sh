# Sourced by the example scripts: sets and exports PYTHON, the interpreter they run, unless it is set already. The
# default is the repository's .venv (what `make run` / `make test` create, shardrl and its dependencies installed),
# so the scripts work without activating it; without a .venv, python3 from PATH.
_shardrl_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$_shardrl_repo/.venv/bin/python" ]]; then
        PYTHON=$_shardrl_repo/.venv/bin/python
    else
        PYTHON=python3
    fi
fi
export PYTHON
unset _shardrl_repo
