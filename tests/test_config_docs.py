"""The yaml files, the dataclass schema and docs/config.md stay in step: every yaml leaf is a dataclass field and
back, and docs/config.md documents every key with the yaml's own default (per config file: all keys of
ppo_trainer.yaml, and for each other file exactly the keys whose default it adds or changes)."""

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from shardrl.job.build import field_paths
from shardrl.job.load import CONFIG_DIR
from shardrl.job.reference import DOC, config_purposes, key_tables
from shardrl.job.schema import PPOConfig

FIELDS = set(field_paths(PPOConfig))
GROUPS = {".".join(p.split(".")[:i]) for p in FIELDS for i in range(1, p.count(".") + 1)}
CONFIG_NAMES = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def raw_tree(name: str) -> dict:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return OmegaConf.to_container(compose(config_name=name), resolve=False)


def leaves(tree: dict, prefix: str = "") -> dict:
    """Leaf keys -> unresolved values; free-form mappings (dict fields) are leaves. Unknown keys fail."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if path in FIELDS:
            out[path] = value
        elif path in GROUPS and isinstance(value, dict):
            out.update(leaves(value, path))
        else:
            raise AssertionError(f"{path} is in the yaml but not in the PPOConfig schema")
    return out


def parent_of(name: str) -> str | None:
    defaults = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())["defaults"]
    parents = [d for d in defaults if isinstance(d, str) and d != "_self_"]
    return parents[0] if parents else None


def doc_value(cell: str):
    assert cell.startswith("`") and cell.endswith("`"), f"default cell {cell!r} is not in backticks"
    return OmegaConf.to_container(OmegaConf.create(f"v: {cell[1:-1]}"), resolve=False)["v"]


TREES = {name: leaves(raw_tree(name)) for name in CONFIG_NAMES}
SECTIONS = key_tables(DOC.read_text())


def test_every_schema_field_is_a_yaml_key_of_some_config():
    present = set().union(*TREES.values())
    assert FIELDS - present == set()


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_doc_section_lists_exactly_the_keys_this_config_sets_with_its_defaults(name):
    tree, parent = TREES[name], parent_of(name)
    expected = tree if parent is None else {k: v for k, v in tree.items()
                                             if k not in TREES[parent] or TREES[parent][k] != v}
    documented = SECTIONS[name]
    assert sorted(set(expected) - set(documented)) == [], "undocumented keys"
    assert sorted(set(documented) - set(expected)) == [], "documented keys this config does not set"
    wrong = {k: (documented[k][0], expected[k]) for k in expected if doc_value(documented[k][0]) != expected[k]}
    assert wrong == {}, "docs default != yaml default"


def test_every_key_has_a_unit_and_a_meaning():
    described = {key for section in SECTIONS.values() for key, cells in section.items()
                 if len(cells) == 3 and cells[1] and cells[2]}
    every_key = set().union(*TREES.values())
    assert sorted(every_key - described) == []


def test_the_table_of_configs_names_every_packaged_config_once():
    assert sorted(config_purposes(DOC.read_text())) == CONFIG_NAMES
