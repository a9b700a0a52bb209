"""Tool and interaction objects from verl-format config files.

A tool config (verl's `multi_turn.tool_config_path`):

    tools:
      - class_name: my_pkg.my_tools.CalcTool            # or path/to/my_tools.py:CalcTool
        config: {type: native, ...}                     # the dict the class is built with, `type` included
        tool_schema: {type: function, function: {...}}  # optional: without it the class gives its own

An interaction config (verl's `multi_turn.interaction_config_path`):

    interaction:
      - name: gsm8k                                     # optional: the class name less `Interaction`, lowercased
        class_name: my_pkg.my_interactions.Gsm8kInteraction
        config: {}                                      # the dict the class is built with, `name` injected

`class_name` is a dotted `module.Class`, imported from sys.path as verl does, or a Python file and a class,
`path/to/file.py:Class`, for code that is not on sys.path; a relative file path is read from the config file's
folder, so the answer does not depend on the process's working directory. Files are read with OmegaConf, so verl's
interpolations (`${oc.env:...}`) resolve as they do there. Every error is one `ToolConfigError` line naming the
file, the entry and what to do instead.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardrl.errors import UserError
from shardrl.agents.interactions import BaseInteraction
from shardrl.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolSchemaError

_TOOL_KEYS = ("class_name", "config", "tool_schema")
_INTERACTION_KEYS = ("name", "class_name", "config")
# The agent loop awaits these; a plain `def` would hand it a tuple where it awaits a coroutine.
_TOOL_METHODS = ("create", "execute", "calc_reward", "release")
_INTERACTION_METHODS = ("start_interaction", "generate_response", "calculate_score", "finalize_interaction")
_VERL_IMPORTS = ("change its imports: verl.tools.base_tool / verl.tools.schemas -> shardrl.agents.tools, "
                 "verl.interactions.base -> shardrl.agents.interactions")


class ToolConfigError(UserError, ValueError):
    """A tool or interaction config file that cannot be loaded; one line naming the file and the entry."""


def load_tools(path: str | Path) -> list[BaseTool]:
    """Every tool of the tool config at `path`, built, in file order; tool names must be unique."""
    file, entries = _read_entries(path, "tools", _TOOL_KEYS)
    tools: list[BaseTool] = []
    owners: dict[str, str] = {}
    for index, entry in enumerate(entries):
        tool = _build_tool(file, index, entry)
        name = getattr(tool, "name", None)
        if not isinstance(name, str):
            raise ToolConfigError(f"{_label(file, 'tools', index, entry)}: the built tool has no `name`; its "
                                  f"__init__ must call super().__init__(config, tool_schema)")
        _claim(owners, name, file, "tools", index, entry)
        tools.append(tool)
    return tools


def tool_schemas_of(path: str | Path) -> list[dict[str, Any]]:
    """The OpenAI function schema (a dict) of every tool at `path`, for rendering prompts before any worker starts.

    A schema written in the file is read without importing the tool's code (which may need packages only the
    rollout workers have); only an entry without one has its class imported and built to give its schema.
    """
    file, entries = _read_entries(path, "tools", _TOOL_KEYS)
    schemas: list[dict[str, Any]] = []
    owners: dict[str, str] = {}
    for index, entry in enumerate(entries):
        _tool_config(file, index, entry)
        schema = _tool_schema(file, index, entry) or _build_tool(file, index, entry).tool_schema
        _claim(owners, schema.function.name, file, "tools", index, entry)
        schemas.append(schema.model_dump())
    return schemas


def interaction_names_of(path: str | Path) -> list[str]:
    """The names the interaction config at `path` gives its entries, without building them (for launch checks)."""
    _, entries = _read_entries(path, "interaction", _INTERACTION_KEYS)
    return [entry.get("name") or _default_interaction_name(entry["class_name"]) for entry in entries]


def load_interactions(path: str | Path) -> dict[str, BaseInteraction]:
    """name -> interaction, built, for every entry of the interaction config at `path`; names must be unique."""
    file, entries = _read_entries(path, "interaction", _INTERACTION_KEYS)
    interactions: dict[str, BaseInteraction] = {}
    owners: dict[str, str] = {}
    for index, entry in enumerate(entries):
        where = f"{file}: interaction[{index}]"
        label = _label(file, "interaction", index, entry)
        name = entry.get("name")
        if name is None:
            name = _default_interaction_name(entry["class_name"])
        if not isinstance(name, str) or not name:
            raise ToolConfigError(f"{where}.name: must be a non-empty string, got {name!r}")
        config = {} if entry.get("config") is None else entry["config"]
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}.config: must be a mapping (the interaction's constructor argument), "
                                  f"got {config!r}")
        _claim(owners, name, file, "interaction", index, entry)
        cls = import_class(entry["class_name"], file.parent, label)
        _check_class(cls, BaseInteraction, _INTERACTION_METHODS, label)
        interactions[name] = _construct(label, cls, config={**config, "name": name})
    return interactions


def _read_entries(path: str | Path, top: str, keys: tuple[str, ...]) -> tuple[Path, list[dict[str, Any]]]:
    """(the file, its `top:` entries as plain dicts), each a mapping of known keys with a `class_name` string."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ToolConfigError(f"{file}: {top} config file not found; check the path")
    try:
        data = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ToolConfigError(f"{file}: not a readable yaml file: {_one_line(exc)}") from exc
    if not isinstance(data, dict) or top not in data:
        raise ToolConfigError(f"{file}: needs a top-level `{top}:` list (verl's format), got "
                              f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    if set(data) != {top}:
        raise ToolConfigError(f"{file}: unknown top-level keys {sorted(set(data) - {top})}; only `{top}:` is read")
    entries = data[top]
    if not isinstance(entries, list):
        raise ToolConfigError(f"{file}: {top}: must be a list of entries, got {entries!r}")
    for index, entry in enumerate(entries):
        where = f"{file}: {top}[{index}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where}: must be a mapping with keys {list(keys)}, got {entry!r}")
        unknown = sorted(set(entry) - set(keys))
        if unknown:
            raise ToolConfigError(f"{where}: unknown keys {unknown}; an entry takes {list(keys)}")
        if not isinstance(entry.get("class_name"), str) or not entry["class_name"]:
            raise ToolConfigError(f"{where}.class_name: missing or not a string, got {entry.get('class_name')!r}; "
                                  f"give pkg.module.Class or path/to/file.py:Class")
    return file, entries


def _label(file: Path, top: str, index: int, entry: dict[str, Any]) -> str:
    return f"{file}: {top}[{index}] ({entry['class_name']})"


def _claim(owners: dict[str, str], name: str, file: Path, top: str, index: int, entry: dict[str, Any]) -> None:
    """Record that entry `index` holds `name`, refusing a name an earlier entry holds."""
    if name in owners:
        raise ToolConfigError(f"{_label(file, top, index, entry)}: name {name!r} is already taken by {owners[name]}; "
                              f"give each entry its own name")
    owners[name] = f"{top}[{index}]"


def _tool_config(file: Path, index: int, entry: dict[str, Any]) -> dict[str, Any]:
    """The entry's `config`, which the tool is built with; only native tools are supported."""
    where = f"{file}: tools[{index}].config"
    config = entry.get("config")
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: missing or not a mapping, got {config!r}; give {{type: native, ...}}")
    if config.get("type") == "mcp":
        raise ToolConfigError(f"{where}.type: mcp tools are not supported yet; wrap the server in a native tool "
                              f"(a BaseTool subclass whose execute calls it) and set type: native")
    if config.get("type") != "native":
        raise ToolConfigError(f"{where}.type: must be native, got {config.get('type')!r}")
    return config


def _tool_schema(file: Path, index: int, entry: dict[str, Any]) -> OpenAIFunctionToolSchema | None:
    """The entry's `tool_schema`, validated, or None when the entry has none."""
    if entry.get("tool_schema") is None:
        return None
    try:
        return OpenAIFunctionToolSchema.model_validate(entry["tool_schema"])
    except ToolSchemaError as exc:
        raise ToolConfigError(f"{file}: tools[{index}]: {' '.join(str(exc).split())}") from exc


def _build_tool(file: Path, index: int, entry: dict[str, Any]) -> BaseTool:
    label = _label(file, "tools", index, entry)
    config = _tool_config(file, index, entry)
    schema = _tool_schema(file, index, entry)
    cls = import_class(entry["class_name"], file.parent, label)
    _check_class(cls, BaseTool, _TOOL_METHODS, label)
    return _construct(label, cls, config=config, tool_schema=schema)


def _construct(label: str, cls: type, **kwargs: Any) -> Any:
    # The user's constructor may raise anything; the error keeps its cause and says which entry built it.
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise ToolConfigError(f"{label}: constructing it failed: {_one_line(exc)}") from exc


def _default_interaction_name(class_name: str) -> str:
    """verl's default: `Gsm8kInteraction` -> `gsm8k`, `Judge` -> `judge`."""
    simple = re.split(r"[.:]", class_name)[-1]
    return simple.removesuffix("Interaction").lower()


def import_class(class_name: str, base_dir: Path, label: str) -> type:
    """The class `pkg.module.Class` (imported from sys.path) or `path/to/file.py:Class` (the file executed)."""
    if ":" in class_name:
        source, _, attr = class_name.rpartition(":")
        module, described = _import_file(source, base_dir, label), source
    else:
        source, _, attr = class_name.rpartition(".")
        if not source:
            raise ToolConfigError(f"{label}: class_name must be pkg.module.Class or path/to/file.py:Class")
        module, described = _import_module(source, attr, label), f"module {source}"
    if not hasattr(module, attr):
        defined = sorted(name for name, value in vars(module).items()
                         if inspect.isclass(value) and value.__module__ == module.__name__)
        raise ToolConfigError(f"{label}: {described} defines no `{attr}`; its classes: {defined}")
    cls = getattr(module, attr)
    if not inspect.isclass(cls):
        raise ToolConfigError(f"{label}: `{attr}` in {described} is not a class but a {type(cls).__name__}")
    return cls


def _import_module(module_name: str, attr: str, label: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if module_name.split(".")[0] == "verl":
            raise ToolConfigError(f"{label}: verl's own classes do not come with shardrl; copy the class into your "
                                  f"code and {_VERL_IMPORTS}") from exc
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise ToolConfigError(f"{label}: no module {module_name} on sys.path; put its folder on PYTHONPATH or "
                                  f"name the file: path/to/file.py:{attr}") from exc
        raise ToolConfigError(f"{label}: importing {module_name} failed: {_import_hint(exc)}") from exc
    except Exception as exc:  # the module's own code raised while it ran
        raise ToolConfigError(f"{label}: importing {module_name} failed: {_one_line(exc)}") from exc


def _import_file(source: str, base_dir: Path, label: str) -> ModuleType:
    """The module of the Python file `source`, executed once per process however many entries name it."""
    file = Path(source).expanduser()
    file = (file if file.is_absolute() else base_dir / file).resolve()
    if file.suffix != ".py" or not file.is_file():
        raise ToolConfigError(f"{label}: no Python file {file}; give an absolute path or one relative to the "
                              f"config file's folder")
    # A name per file path, so two files with the same stem do not replace each other.
    stem = re.sub(r"\W", "_", file.stem)
    name = f"shardrl_user_{stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickling look a class's module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the file's own code raised while it ran
        del sys.modules[name]
        hint = _import_hint(exc) if isinstance(exc, ModuleNotFoundError) else _one_line(exc)
        raise ToolConfigError(f"{label}: running {file} failed: {hint}") from exc
    return module


def _import_hint(exc: ModuleNotFoundError) -> str:
    """The error, and for a verl class whose imports were not changed, which ones to change."""
    if exc.name is not None and exc.name.split(".")[0] == "verl":
        return f"{_one_line(exc)}; {_VERL_IMPORTS}"
    return _one_line(exc)


def _check_class(cls: type, base: type, methods: tuple[str, ...], label: str) -> None:
    if not issubclass(cls, base):
        raise ToolConfigError(f"{label}: {cls.__qualname__} is not a subclass of {base.__module__}.{base.__name__}; "
                              f"subclass it (a verl class: {_VERL_IMPORTS})")
    for method in methods:
        if not inspect.iscoroutinefunction(getattr(cls, method)):
            raise ToolConfigError(f"{label}: {cls.__qualname__}.{method} must be `async def` (the agent loop awaits "
                                  f"it)")


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
