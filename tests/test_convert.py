"""The converter CLI: hf-to-dist then dist-to-hf reproduces the original HF checkpoint bitwise (tensor names, dtypes
and values, config, tokenizer files); bad inputs end with one line naming the path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardrl.models.convert import main
from shardrl.models.tiny import make_tiny_checkpoint

TOKENIZER_CONFIG = '{"model_max_length": 64, "padding_side": "left"}\n'  # stands in for the tokenizer files


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (single file or sharded)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_bitwise_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name].view(torch.uint8), tensor.view(torch.uint8)), f"{name}: bits differ"


@pytest.mark.parametrize("family, shard_size", [("llama", None), ("qwen2_moe", "20KB")])
def test_hf_to_dist_to_hf_is_bitwise(tmp_path, family, shard_size):
    # llama: tied embeddings, biases, rope scaling; qwen2_moe: experts, shared expert, a sharded index file.
    hf = make_tiny_checkpoint(family, tmp_path / "hf", max_shard_size=shard_size)
    (hf / "tokenizer_config.json").write_text(TOKENIZER_CONFIG)
    main(["hf-to-dist", "--hf", str(hf), "--out", str(tmp_path / "dist")])
    assert not list((tmp_path / "dist").glob("*.safetensors")), "hf-to-dist must write a DCP checkpoint"
    main(["dist-to-hf", "--dist", str(tmp_path / "dist"), "--out", str(tmp_path / "back")])
    assert_bitwise_equal(hf_tensors(tmp_path / "back"), hf_tensors(hf))
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert (tmp_path / "back" / "tokenizer_config.json").read_text() == TOKENIZER_CONFIG


def test_dist_to_hf_with_config_from_elsewhere_and_dtype(tmp_path):
    hf = make_tiny_checkpoint("qwen3", tmp_path / "hf")
    main(["hf-to-dist", "--hf", str(hf), "--out", str(tmp_path / "dist")])
    (tmp_path / "dist" / "config.json").unlink()  # a checkpoint stored without its config
    main(["dist-to-hf", "--dist", str(tmp_path / "dist"), "--out", str(tmp_path / "back"),
          "--config", str(hf / "config.json"), "--dtype", "bfloat16"])
    back, original = hf_tensors(tmp_path / "back"), hf_tensors(hf)
    assert_bitwise_equal(back, {name: t.to(torch.bfloat16) for name, t in original.items()})


def test_missing_checkpoint_is_one_line_from_the_command_line(tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    run = subprocess.run([sys.executable, "-m", "shardrl.models.convert", "dist-to-hf", "--dist", str(missing),
                          "--out", str(tmp_path / "out"), "--config", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and str(tmp_path) in run.stderr, run.stderr


@pytest.mark.parametrize("argv, message", [
    (["hf-to-dist", "--hf", "{tmp}/empty", "--out", "{tmp}/dist"], "{tmp}/empty/config.json: no config.json found"),
    (["dist-to-hf", "--dist", "{tmp}/empty", "--out", "{tmp}/hf", "--config", "{hf}"],
     "{tmp}/empty: no distributed checkpoint here (no .metadata file)"),
])
def test_bad_inputs_exit_with_one_line(tmp_path, capsys, argv, message):
    hf = make_tiny_checkpoint("qwen2", tmp_path / "model")
    (tmp_path / "empty").mkdir()
    fill = dict(tmp=tmp_path, hf=hf)
    capsys.readouterr()  # drop transformers' progress output
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(**fill) for a in argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: {message.format(**fill)}\n"
