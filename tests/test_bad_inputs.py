"""Bad input of every kind the user can give (model directories, tokenizers, data files, reward functions, tool
configs) ends the run with one `error:` line naming the key or file (and function or row) and what to do, exit
code 2, no traceback, before any worker starts; one case per class runs the real command line, and one reaches a
worker, whose UserError is reported the same way with the rank and node it came from."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from shardrl.data import builtin_task
from shardrl.job.load import CONFIG_DIR
from shardrl.trainer import main_ppo

QUICK = ["trainer.total_training_steps=1", "trainer.logger=[file]", "trainer.test_freq=-1",
         "trainer.val_before_train=false", "trainer.save_freq=-1"]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, Path]:
    """The built-in task's model and 64 of its rows, and bad variants of each."""
    root = tmp_path_factory.mktemp("bad")
    built = builtin_task.prepare(root / "builtin")
    model = Path(built["model"])
    rows = pq.read_table(built["train_files"]).slice(0, 64).to_pylist()
    paths = {"root": root, "model": model, "train": _parquet(root / "train.parquet", rows)}

    def model_variant(name: str, edit) -> None:
        shutil.copytree(model, root / name)
        edit(root / name)
        paths[name] = root / name

    def config_edit(change):
        def edit(directory: Path) -> None:
            config = json.loads((directory / "config.json").read_text())
            (directory / "config.json").write_text(json.dumps(change(config)))
        return edit

    model_variant("no_weights", lambda d: (d / "model.safetensors").unlink())
    model_variant("unknown_arch", config_edit(lambda c: {**c, "architectures": ["FooForCausalLM"]}))
    model_variant("no_hidden_size", config_edit(lambda c: {k: v for k, v in c.items() if k != "hidden_size"}))
    model_variant("bad_json", lambda d: (d / "config.json").write_text("{not json"))
    model_variant("vocab_mismatch", config_edit(lambda c: {**c, "vocab_size": c["vocab_size"] - 4}))
    model_variant("garbled_header", lambda d: (d / "model.safetensors").write_bytes(b"\x10" * 64))
    model_variant("cut_short", lambda d: _truncate(d / "model.safetensors", 0.9))
    model_variant("missing_shard", lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}})))
    model_variant("renamed_tensor", _rename_a_tensor)
    model_variant("no_tokenizer", lambda d: [p.unlink() for p in d.iterdir() if "token" in p.name])
    paths["wider_tokenizer"] = _wider_tokenizer(model, root / "wider_tokenizer")
    (root / "empty.parquet").write_bytes(b"")
    (root / "junk.parquet").write_bytes(b"PAR1 not a parquet file")
    (root / "junk.jsonl").write_text('{"prompt": []}\n{oops\n')
    (root / "rows.csv").write_text("prompt\nhi\n")
    for name, change in {
        "no_prompt": lambda r: {k: v for k, v in r.items() if k != "prompt"},
        "int_prompt": lambda r: {**r, "prompt": 7},
        "no_role": lambda r: {**r, "prompt": [{"content": "hi"}]},
        "long_prompt": lambda r: {**r, "prompt": [{"role": "user", "content": " ".join(["7 8 9"] * 400)}]},
        "unknown_source": lambda r: {**r, "data_source": "someone/else"},
    }.items():
        paths[name] = _parquet(root / f"{name}.parquet", [change(r) for r in rows])
    for name, source in {
        "syntax": "def compute_score(:\n",
        "import": "import no_such_module_xyz\n",
        "no_function": "def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
        "one_argument": "def compute_score(solution):\n    return 0.0\n",
    }.items():
        (root / f"reward_{name}.py").write_text(source)
    (root / "tools_no_config.yaml").write_text("tools: [ {class_name: no.such:Tool} ]\n")
    (root / "tools_bad_yaml.yaml").write_text("tools: [\n")
    (root / "tools_no_module.yaml").write_text(
        "tools:\n  - class_name: no_such_pkg.tools:Tool\n    config: {type: native}\n")
    return paths


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _truncate(file: Path, fraction: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * fraction)])


def _wider_tokenizer(model: Path, directory: Path) -> Path:
    """The model's tokenizer with one more token, which every built-in prompt contains: its id is past the
    model's vocabulary."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(["->"])
    tokenizer.save_pretrained(directory)
    return directory


def _rename_a_tensor(directory: Path) -> None:
    """The same weights with one tensor under a name the model does not have: every header check passes, and the
    launch finds the model's tensor missing (as the worker building the model would)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(directory / "model.safetensors")
    name = next(n for n in tensors if "layers.0.mlp.down_proj" in n)
    tensors[name.replace("down_proj", "down_projection")] = tensors.pop(name)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def raw(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


# case -> (overrides given the task's paths, what the one line says after "error: ")
CASES = {
    # models
    "model path missing": (lambda p: [f"actor_rollout_ref.model.path={p['root']}/nowhere"],
                           r"actor_rollout_ref\.model\.path: .*/nowhere is not a local model directory; download"),
    "hub id, offline": (lambda p: ["actor_rollout_ref.model.path=someorg/somemodel"],
                        r"actor_rollout_ref\.model\.path: someorg/somemodel is not a local model directory"),
    "no weights": (lambda p: [f"actor_rollout_ref.model.path={p['no_weights']}"],
                   r"model\.path: .*/no_weights: neither model\.safetensors nor model\.safetensors\.index\.json"),
    "unknown architecture": (lambda p: [f"actor_rollout_ref.model.path={p['unknown_arch']}"],
                             r"model\.path: .*/unknown_arch/config\.json: .*'FooForCausalLM'\] is not supported"),
    "config.json field missing": (lambda p: [f"actor_rollout_ref.model.path={p['no_hidden_size']}"],
                                  r"model\.path: .*/no_hidden_size/config\.json: has no 'hidden_size'"),
    "config.json not JSON": (lambda p: [f"actor_rollout_ref.model.path={p['bad_json']}"],
                             r"model\.path: .*/bad_json/config\.json is not valid JSON \(Expecting"),
    "weights of another vocabulary": (lambda p: [f"actor_rollout_ref.model.path={p['vocab_mismatch']}"],
                                      r"model\.path: .*/vocab_mismatch: model\.embed_tokens\.weight has shape "
                                      r"\(\d+, \d+\), config\.json says vocab_size x hidden_size"),
    "garbled weights header": (lambda p: [f"actor_rollout_ref.model.path={p['garbled_header']}"],
                               r"model\.path: .*/garbled_header/model\.safetensors: not a safetensors file"),
    "truncated weights": (lambda p: [f"actor_rollout_ref.model.path={p['cut_short']}"],
                          r"model\.path: .*/cut_short/model\.safetensors: truncated \(\d+ bytes, its header "
                          r"describes \d+\)"),
    "missing shard": (lambda p: [f"actor_rollout_ref.model.path={p['missing_shard']}"],
                      r"model\.path: .*/model-00002-of-00002\.safetensors: shard file listed in .* is missing"),
    # tokenizers
    "tokenizer path missing": (lambda p: [f"data.tokenizer={p['root']}/no_tok"],
                               r"data\.tokenizer: .*/no_tok is not a local tokenizer directory"),
    "no tokenizer files": (lambda p: [f"actor_rollout_ref.model.path={p['no_tokenizer']}"],
                           r"actor_rollout_ref\.model\.path: .*/no_tokenizer: no tokenizer files \(none of "
                           r"tokenizer\.json"),
    "tokenizer beyond the vocabulary": (lambda p: [f"data.tokenizer={p['wider_tokenizer']}"],
                                        r"data\.tokenizer: prompt 0 of .*train\.parquet has token id \d+, but "
                                        r"the model \(.*\) has vocab_size \d+; use the model's own tokenizer"),
    # data
    "empty parquet": (lambda p: [f"data.train_files={p['root']}/empty.parquet"],
                      r"data\.train_files: .*/empty\.parquet: not a readable parquet file .*; write it again"),
    "corrupt parquet": (lambda p: [f"data.train_files={p['root']}/junk.parquet"],
                        r"data\.train_files: .*/junk\.parquet: not a readable parquet file"),
    "jsonl line not JSON": (lambda p: [f"data.train_files={p['root']}/junk.jsonl"],
                            r"data\.train_files: .*/junk\.jsonl line 2: not JSON"),
    "unsupported format": (lambda p: [f"data.train_files={p['root']}/rows.csv"],
                           r"data\.train_files: .*/rows\.csv: unsupported suffix '\.csv' for RL data"),
    "no prompt column": (lambda p: [f"data.train_files={p['no_prompt']}"],
                         r"data\.train_files: .*/no_prompt\.parquet: missing column 'prompt'; it has columns"),
    "prompt of the wrong type": (lambda p: [f"data.train_files={p['int_prompt']}"],
                                 r"data\.train_files: .*/int_prompt\.parquet row 0: 'prompt' must be a list of "
                                 r"chat messages, got int"),
    "message without a role": (lambda p: [f"data.train_files={p['no_role']}"],
                               r"data\.train_files: .*/no_role\.parquet row 0: 'prompt' must be a non-empty list "
                               r"of messages with a 'role'"),
    "overlong prompt, truncation=error": (lambda p: [f"data.train_files={p['long_prompt']}", "data.truncation=error"],
                                          r"data\.train_files: .*/long_prompt\.parquet row 0: prompt has \d+ tokens "
                                          r"> data\.max_prompt_length=\d+; set data\.truncation"),
    "val file missing": (lambda p: [f"data.val_files={p['root']}/no_val.parquet"],
                         r"data\.val_files: .*/no_val\.parquet does not exist"),
    "unknown data_source": (lambda p: [f"data.train_files={p['unknown_source']}"],
                            r"data data_source: prompt 0 of .*/unknown_source\.parquet has "
                            r"data_source='someone/else', which no built-in scorer handles"),
    # reward functions
    "reward file does not parse": (lambda p: [f"custom_reward_function.path={p['root']}/reward_syntax.py"],
                                   r"custom_reward_function\.path: cannot load reward function .*reward_syntax\.py:"
                                   r"compute_score: SyntaxError"),
    "reward file's import fails": (lambda p: [f"custom_reward_function.path={p['root']}/reward_import.py"],
                                   r"custom_reward_function\.path: .*reward_import\.py:compute_score: "
                                   r"ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    "reward function missing": (lambda p: [f"custom_reward_function.path={p['root']}/reward_no_function.py"],
                                r"custom_reward_function\.path: .*reward_no_function\.py has no attribute "
                                r"'compute_score'"),
    "reward function's signature": (lambda p: [f"custom_reward_function.path={p['root']}/reward_one_argument.py"],
                                    r"custom_reward_function\.path: .*compute_score\(solution\) cannot take the 4 "
                                    r"positional arguments each call passes"),
    # tools
    "tool without config": (lambda p: ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                       f"actor_rollout_ref.rollout.multi_turn.tool_config_path="
                                       f"{p['root']}/tools_no_config.yaml"],
                            r"multi_turn\.tool_config_path: .*tools_no_config\.yaml: tools\[0\]\.config: missing"),
    "tool config not yaml": (lambda p: ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                        f"actor_rollout_ref.rollout.multi_turn.tool_config_path="
                                        f"{p['root']}/tools_bad_yaml.yaml"],
                             r"multi_turn\.tool_config_path: .*tools_bad_yaml\.yaml: not a readable yaml file"),
    "tool class not importable": (lambda p: ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                             f"actor_rollout_ref.rollout.multi_turn.tool_config_path="
                                             f"{p['root']}/tools_no_module.yaml"],
                                  r"multi_turn\.tool_config_path: .*no_such_pkg"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_error_line_before_workers_start(case, task, tmp_path, capsys, monkeypatch):
    def no_workers(*args, **kwargs):
        raise AssertionError("workers were started")

    monkeypatch.setattr("shardrl.trainer.launch.init_ray", no_workers)
    overrides, message = CASES[case]
    defaults = [f"actor_rollout_ref.model.path={task['model']}", f"data.train_files={task['train']}"]
    given = overrides(task)
    keys = {o.partition("=")[0] for o in given}
    start = time.monotonic()
    status = main_ppo.run(raw([f"trainer.default_local_dir={tmp_path}", *QUICK,
                               *(d for d in defaults if d.partition("=")[0] not in keys), *given]))
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(message, err), err
    assert time.monotonic() - start < 60


def _command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={run_dir}", *QUICK,
            *overrides]


def test_the_command_line_prints_the_line_and_exits_2(task, tmp_path):
    done = subprocess.run(_command(tmp_path, f"actor_rollout_ref.model.path={task['garbled_header']}"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and "garbled_header/model.safetensors: not a safetensors file" in done.stderr


def test_a_user_error_a_worker_raises_is_the_same_line_with_its_rank_and_node(task, tmp_path):
    """A distributed checkpoint directory that holds none: only the worker that reads it finds out."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    empty = tmp_path / "no_checkpoint"
    empty.mkdir()
    done = subprocess.run(_command(tmp_path, f"data.train_files={task['train']}",
                                   "actor_rollout_ref.actor.megatron.use_dist_checkpointing=true",
                                   f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={empty}"),
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: worker group 'trainer', role 'actor', 'add_role': rank 0 on "), last
    assert "raised CheckpointError: " in last and "no shardrl checkpoint here" in last, last


def test_a_checkpoint_missing_a_tensor_is_refused_before_workers_start(task, tmp_path):
    done = subprocess.run(_command(tmp_path, f"actor_rollout_ref.model.path={task['renamed_tensor']}",
                                   f"data.train_files={task['train']}"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith("error: actor_rollout_ref.model.path: ") and "lacks 1 tensor(s) the model needs " \
        "(e.g. 'model.layers.0.mlp.down_proj.weight')" in done.stderr, done.stderr


def test_tracebacks_come_back_under_the_debug_flag(task, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDRL_DEBUG", "1")
    from shardrl.job.errors import ConfigError
    with pytest.raises(ConfigError, match="not a local model directory"):
        main_ppo.run(raw([f"trainer.default_local_dir={tmp_path}", *QUICK, "actor_rollout_ref.model.path=/nowhere"]))


def test_a_bug_of_ours_is_one_line_too_with_exit_1(tmp_path, capsys, monkeypatch):
    def broken(plan):
        raise IndexError("list index out of range\nmore")

    monkeypatch.setattr("shardrl.trainer.launch.train", broken)
    assert main_ppo.run(raw([f"trainer.default_local_dir={tmp_path}", *QUICK])) == 1
    assert capsys.readouterr().err == ("error: internal error, IndexError: list index out of range (a shardrl bug: "
                                       "SHARDRL_DEBUG=1 prints the traceback to report)\n")
