"""docs/config.md read back: the reference users read is also the source of `--help`'s one-line descriptions, and
tests/test_config_docs.py checks it against the yaml and the schema with the same reader.

The doc has a table of the configs (`| `<name>.yaml` | what it is for |`) and, per config, sections headed
'## `<name>.yaml` ...' whose rows are `| `<dotted.key>` | default | unit | meaning |` (the derived configs'
sections: `| key | default | note |`). The file sits beside the package in a source checkout; an installed wheel
does not carry it (`DOC.is_file()` says which).
"""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def key_tables(text: str) -> dict[str, dict[str, list[str]]]:
    """Config name -> {dotted key: the row's other cells}, from the sections headed '## `<name>.yaml` ...'."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line.split("`")[1].removesuffix(".yaml") if ".yaml`" in line else None
            if current:
                sections[current] = {}
        elif current and line.startswith("| `"):
            key, *rest = _cells(line)
            key = key.strip("`")
            if key in sections[current]:
                raise ValueError(f"docs/config.md: {key} documented twice in the {current} section")
            sections[current][key] = rest
    return sections


def config_purposes(text: str) -> dict[str, str]:
    """Config name -> what it is for, from the table of configs before the first section."""
    purposes = {}
    for line in text.split("\n## ", 1)[0].splitlines():
        if line.startswith("| `") and ".yaml`" in line:
            name, purpose = _cells(line)[:2]
            purposes[name.strip("`").removesuffix(".yaml")] = purpose
    return purposes


def one_line(meaning: str, width: int = 100) -> str:
    """A doc cell shortened to its first clause (up to '; '), backticks dropped, at most `width` characters."""
    text = meaning.split("; ", 1)[0].replace("`", "")
    return text if len(text) <= width else text[:width - 3].rsplit(" ", 1)[0] + " ..."
