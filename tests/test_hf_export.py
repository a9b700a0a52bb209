"""The HF export is a self-contained model directory: transformers loads the run's tokenizer (same ids, same chat
template) and the generation ids from it, every file is readable, and a crash while writing leaves the previous
export whole. (That the exported trained model answers the task and stops: tests/test_default_job.py.)"""

import json
import shutil
import stat
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from shardrl.data import builtin_task
from shardrl.models.hf_export import export_dir


def test_export_holds_the_runs_tokenizer_and_generation_ids_readably(tmp_path):
    source = tmp_path / "model"
    builtin_task.make_tokenizer(source)
    builtin_task.make_model(source)
    tokenizer = AutoTokenizer.from_pretrained(source)  # as the run loads it

    def write_weights(directory: Path) -> None:  # what the workers write: weights 0600, config, generation config
        directory.mkdir()
        for name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copyfile(source / name, directory / name)
        (directory / "model.safetensors").chmod(0o600)

    out = tmp_path / "run" / "hf_export"
    out.parent.mkdir()
    export_dir(out, write_weights, tokenizer)
    exported = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "3 8 1 ->"}]
    assert exported.apply_chat_template(chat)["input_ids"] == tokenizer.apply_chat_template(chat)["input_ids"]
    assert exported.chat_template == tokenizer.chat_template
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.eos_token_id, generation.pad_token_id) == (eos, eos)
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 14
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes.values()) == {0o644} and {"tokenizer.json", "generation_config.json"} <= modes.keys(), modes
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf_export"]  # no temporary directory left

    def crash(directory: Path) -> None:
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        raise RuntimeError("killed while writing")

    with pytest.raises(RuntimeError):
        export_dir(out, crash, tokenizer)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 14  # the previous export, whole
    export_dir(out, write_weights, tokenizer)  # the next export clears the crashed one's leftovers
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf_export"]
