"""On-policy distillation (verl's `distillation` keys): the loss against hand-computed values, its guards (padding,
clamps, micro-batch splits), the config's refusals, the teacher at another layout than the student, and a student
trained against a fixed teacher alone moving toward it; for the estimators and for forward_kl_topk (the teacher's
top k against transformers', the student's loss the same at every micro-batch cut, DP, TP and CP)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from shardrl.algos.aggregate import LossScale
from shardrl.algos.distillation import (
    DistillationSettings,
    TopKOverlap,
    distillation_loss,
    overlap_token_advantage,
    topk_distillation_loss,
)
from shardrl.algos.policy_loss import ClipRange
from shardrl.controller.rank_env import COLLECTIVE_TIMEOUT_ENV
from shardrl.data import builtin_task
from shardrl.data.batch import Batch
from shardrl.data.chat import prompt_token_ids
from shardrl.job.errors import ConfigError
from shardrl.job.load import compose
from shardrl.job.plan import plan_job
from shardrl.parallel.launch import run_distributed
from shardrl.trainer.launch import check_teacher_vocabulary


def settings(estimator="k1", policy_gradient=True, **kw):
    base = dict(use_task_rewards=False, coef=1.0, loss_max_clamp=None, log_prob_min_clamp=None, clip=ClipRange(0.2))
    return DistillationSettings(estimator, policy_gradient, **(base | kw))


STUDENT = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
TEACHER = torch.tensor([[-0.5, -2.5, -4.0], [-1.2, -1.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 5 tokens


def test_supervised_k3_is_the_token_mean_of_k3_and_its_gradient():
    student = STUDENT.clone().requires_grad_()
    loss, metrics = distillation_loss(student, STUDENT, TEACHER, MASK, LossScale.from_mask(MASK, 3), "token-mean",
                                      settings("k3", policy_gradient=False))
    pairs = [(-1.0, -0.5), (-2.0, -2.5), (-0.5, -4.0), (-0.2, -1.2), (-3.0, -1.0)]
    k3 = [math.exp(t - s) - (t - s) - 1 for s, t in pairs]  # r - 1 - log r, r = p_t / p_s
    assert loss.item() == pytest.approx(sum(k3) / 5)
    assert metrics["reverse_kl"].item() == pytest.approx(sum(s - t for s, t in pairs) / 5)
    loss.backward()
    # d k3 / d log p_s = 1 - p_t / p_s
    expected = [[(1 - math.exp(t - s)) / 5 for s, t in pairs[:3]], [(1 - math.exp(t - s)) / 5 for s, t in pairs[3:]]
                + [0.0]]
    torch.testing.assert_close(student.grad, torch.tensor(expected))


def test_policy_gradient_k1_uses_minus_the_reverse_kl_as_advantage():
    """At the anchor (ratio 1, nothing clipped) the surrogate is -A = d per token, and its gradient is -A = d as
    well, through the student's log-prob only: the teacher's choice gets pushed up."""
    student = STUDENT.clone().requires_grad_()
    loss, metrics = distillation_loss(student, STUDENT, TEACHER, MASK, LossScale.from_mask(MASK, 3), "token-mean",
                                      settings("k1"))
    d = (STUDENT - TEACHER) * MASK
    assert loss.item() == pytest.approx(float(d.sum() / 5))
    loss.backward()
    torch.testing.assert_close(student.grad, d / 5)
    assert metrics["pg_clipfrac"].item() == 0.0


def test_clamps_and_padding_never_reach_the_loss():
    student = STUDENT.clone()
    student[1, 2] = float("nan")
    teacher = TEACHER.clone()
    teacher[1, 2] = -float("inf")
    teacher[0, 2] = -40.0  # clamped to -10, then d to [-2, 2]
    student = student.requires_grad_()
    loss, _ = distillation_loss(student, STUDENT, teacher, MASK, LossScale.from_mask(MASK, 3), "token-mean",
                                settings("k1", policy_gradient=False, loss_max_clamp=2.0, log_prob_min_clamp=-10.0))
    d = [-0.5, 0.5, 2.0, 1.0, -2.0]  # -0.5 - (-10) = 9.5 clamped to 2; -3 - (-1) = -2
    assert loss.item() == pytest.approx(sum(d) / 5)
    loss.backward()
    assert torch.isfinite(student.grad).all() and student.grad[1, 2] == 0.0


def test_micro_batches_add_up_to_the_whole_batch():
    rows = [slice(0, 1), slice(1, 2)]
    whole_scale = LossScale.from_mask(MASK, 3)
    for estimator, pg in (("k1", True), ("k3", False)):
        whole, _ = distillation_loss(STUDENT, STUDENT, TEACHER, MASK, whole_scale, "seq-mean-token-mean",
                                     settings(estimator, pg))
        parts = sum(distillation_loss(STUDENT[r], STUDENT[r], TEACHER[r], MASK[r], whole_scale, "seq-mean-token-mean",
                                      settings(estimator, pg))[0] for r in rows)
        assert parts.item() == pytest.approx(whole.item())


def test_forward_kl_topk_is_floored_at_zero_then_the_loss_or_minus_the_advantage():
    """Supervised: the token mean of max(d, 0), its gradient into d (none where d < 0: the top k hold less than all
    the mass); policy gradient at the anchor: the same value, its gradient through the student's log-prob only."""
    forward_kl = torch.tensor([[0.3, -0.2, 1.5], [0.7, 0.1, 9.0]])
    masses = torch.tensor([[0.5, 0.9, 0.2], [0.6, 0.7, 0.0]]), torch.tensor([[0.8, 0.8, 0.9], [0.7, 0.9, 1.0]])
    scale = LossScale.from_mask(MASK, 3)
    # 2, 0, 4 / 1, 3 of the teacher's top 4 in the student's (the last position is padding)
    overlap = TopKOverlap(torch.tensor([[2.0, 0.0, 4.0], [1.0, 3.0, 4.0]]),
                          torch.tensor([[-0.4, 0.0, -2.0], [-0.1, -0.6, 99.0]]))
    d = forward_kl.clone().requires_grad_()
    loss, metrics = topk_distillation_loss(d, *masses, STUDENT, STUDENT, MASK, scale, "token-mean",
                                           settings("forward_kl_topk", policy_gradient=False, topk=4), overlap)
    assert loss.item() == pytest.approx((0.3 + 0.0 + 1.5 + 0.7 + 0.1) / 5)
    assert metrics["student_mass"].item() == pytest.approx((0.5 + 0.9 + 0.2 + 0.6 + 0.7) / 5)
    assert metrics["teacher_mass"].item() == pytest.approx((0.8 + 0.8 + 0.9 + 0.7 + 0.9) / 5)
    assert metrics["overlap_ratio"].item() == pytest.approx((2 + 0 + 4 + 1 + 3) / 4 / 5)
    steps = {f"distillation/{k}": [v.item()] for k, v in metrics.items() if k.startswith("overlap_")}
    # the mean over the four positions with any overlap of advantage_sum / count
    assert overlap_token_advantage(steps)["distillation/overlap_token_advantage"] == pytest.approx(
        [(-0.4 / 2 - 2.0 / 4 - 0.1 / 1 - 0.6 / 3) / 4])
    loss.backward()
    torch.testing.assert_close(d.grad, torch.tensor([[0.2, 0.0, 0.2], [0.2, 0.2, 0.0]]))
    student = STUDENT.clone().requires_grad_()
    loss, _ = topk_distillation_loss(forward_kl.requires_grad_(), *masses, student, STUDENT, MASK, scale,
                                     "token-mean", settings("forward_kl_topk", topk=4), overlap)
    assert loss.item() == pytest.approx((0.3 + 0.0 + 1.5 + 0.7 + 0.1) / 5)
    loss.backward()
    floored = (forward_kl.detach().clamp_min(0) * MASK) / 5
    torch.testing.assert_close(student.grad, floored)
    assert forward_kl.grad is None


@pytest.mark.parametrize("overrides, key", [
    (["distillation.enabled=true"], "distillation.teacher_models.teacher_model.model_path"),
    (["distillation.enabled=true", "distillation.teacher_model.model_path=/t",
      "distillation.distillation_loss.loss_mode=forward_kl_topk_tail"], "distillation.distillation_loss.loss_mode"),
    (["distillation.enabled=true", "distillation.teacher_model.model_path=/t",
      "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=false"],
     "distillation.distillation_loss.loss_mode"),
    (["distillation.teacher_model.megatron.seed=3"], "distillation.teacher_model.megatron.seed"),
])
def test_config_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        plan_job(compose("ppo_trainer", overrides))
    assert err.value.key == key


def make_teacher(task: dict, out: Path, layers: int = 4, hidden: int = 96, std: float = 0.3, seed: int = 7) -> Path:
    """A teacher of another size than the student, with the student's tokenizer and a peaked random init."""
    student = AutoConfig.from_pretrained(task["model"])
    config = AutoConfig.for_model(
        "qwen2", vocab_size=student.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=student.eos_token_id,
        pad_token_id=student.pad_token_id, initializer_range=std, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(task["model"]).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return builtin_task.prepare(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="module")
def teacher(task, tmp_path_factory):
    return make_teacher(task, tmp_path_factory.mktemp("teacher"))


def test_a_teacher_with_another_vocabulary_is_refused(task, tmp_path):
    other = AutoTokenizer.from_pretrained(task["model"])
    other.add_tokens(["<tool>"])
    other.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="vocabulary .* differs from the student's") as err:
        check_teacher_vocabulary("distillation.teacher_models.math.model_path", str(tmp_path),
                                 AutoTokenizer.from_pretrained(task["model"]), False)
    assert err.value.key == "distillation.teacher_models.math.model_path"


def teacher_scores(model_path: str, teacher_path: str, overrides: list[str], batch: Batch) -> dict:
    from shardrl.workers.teacher import TeacherWorker

    os.environ[COLLECTIVE_TIMEOUT_ENV] = "120"
    plan = plan_job(compose("ppo_trainer", overrides)).with_total_steps(1)
    worker = TeacherWorker(plan.teacher.by_key["default"])
    return dict(worker.compute_log_prob(batch).tensors.items())


def teacher_log_probs(model_path: str, teacher_path: str, overrides: list[str], batch: Batch):
    return teacher_scores(model_path, teacher_path, overrides, batch)["teacher_log_probs"]


def sample_batch(vocab: int) -> Batch:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (4, 6), generator=generator)
    mask = torch.ones(4, 6, dtype=torch.long)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(6).expand(4, 6),
                  "responses": ids[:, 3:], "response_mask": torch.ones(4, 3)})


def test_the_teacher_at_tp2_and_at_pp2_gives_the_single_process_log_probs(task, teacher):
    """The teacher is laid out by its own megatron keys (here TP2, then PP2 over 2 ranks), whatever the student's
    layout, and scores exactly as one process does."""
    base = ["trainer.device=cpu", f"distillation.enabled=true", f"distillation.teacher_model.model_path={teacher}",
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"]
    batch = sample_batch(AutoConfig.from_pretrained(task["model"]).vocab_size)
    single = teacher_log_probs(task["model"], str(teacher), base + ["trainer.n_gpus_per_node=1"], batch)
    # hand check of the single-process teacher: transformers' own log-probs of the response tokens
    model = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        logits = model(batch.tensors["input_ids"]).logits[:, 2:5].log_softmax(-1)
    expected = logits.gather(-1, batch.tensors["responses"][..., None])[..., 0]
    torch.testing.assert_close(single, expected, rtol=1e-5, atol=1e-5)
    for layout in (["distillation.teacher_model.megatron.tensor_model_parallel_size=2"],
                   ["distillation.teacher_model.megatron.pipeline_model_parallel_size=2"]):
        overrides = base + ["trainer.n_gpus_per_node=2"] + layout
        ranks = run_distributed(2, teacher_log_probs, task["model"], str(teacher), overrides, batch)
        for scored in ranks:
            torch.testing.assert_close(scored, single, rtol=1e-5, atol=1e-5)


def test_the_teacher_topk_at_tp2_and_at_pp2_is_transformers_topk(task, teacher):
    """forward_kl_topk's teacher: the top 5 log-probs and ids of every response position, as transformers' full
    log_softmax gives them, at one process, TP2 and PP2; the student's tokens do not matter to them."""
    base = ["trainer.device=cpu", "distillation.enabled=true", f"distillation.teacher_model.model_path={teacher}",
            "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=5",
            "distillation.distillation_loss.use_policy_gradient=false", "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"]
    batch = sample_batch(AutoConfig.from_pretrained(task["model"]).vocab_size)
    model = AutoModelForCausalLM.from_pretrained(teacher)
    with torch.no_grad():
        expected = model(batch.tensors["input_ids"]).logits[:, 2:5].log_softmax(-1).topk(5, dim=-1)
    single = teacher_scores(task["model"], str(teacher), base + ["trainer.n_gpus_per_node=1"], batch)
    assert single["teacher_topk_ids"].shape == (4, 3, 5) and single["teacher_topk_ids"].dtype == torch.int32
    assert torch.equal(single["teacher_topk_ids"].long(), expected.indices)
    torch.testing.assert_close(single["teacher_topk_log_probs"], expected.values, rtol=1e-5, atol=1e-5)
    for layout in (["distillation.teacher_model.megatron.tensor_model_parallel_size=2"],
                   ["distillation.teacher_model.megatron.pipeline_model_parallel_size=2"]):
        overrides = base + ["trainer.n_gpus_per_node=2"] + layout
        for scored in run_distributed(2, teacher_scores, task["model"], str(teacher), overrides, batch):
            assert torch.equal(scored["teacher_topk_ids"], single["teacher_topk_ids"]), layout
            torch.testing.assert_close(scored["teacher_topk_log_probs"], single["teacher_topk_log_probs"],
                                       rtol=1e-5, atol=1e-5)


def test_topk_above_the_vocabulary_is_refused_before_workers_start():
    from shardrl.trainer.launch import check_distillation_topk

    with pytest.raises(ConfigError, match="exceeds the vocabulary's 14 tokens") as err:
        check_distillation_topk(settings("forward_kl_topk", policy_gradient=False, topk=15), 14)
    assert err.value.key == "distillation.distillation_loss.topk"
    check_distillation_topk(settings("forward_kl_topk", policy_gradient=False, topk=14), 14)


def first_token_kl(student_dir: Path, teacher_dir: Path, prompts: list[list[int]], forward: bool) -> float:
    """Exact KL(student || teacher), or with `forward` KL(teacher || student), of the first response token's
    distribution, averaged over fixed prompts (no sampling noise: the full softmax of both models)."""
    student, teacher = (AutoModelForCausalLM.from_pretrained(d) for d in (student_dir, teacher_dir))
    total = 0.0
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            log_s = student(x).logits[0, -1].log_softmax(-1)
            log_t = teacher(x).logits[0, -1].log_softmax(-1)
            p, log_p, log_q = (log_t.exp(), log_t, log_s) if forward else (log_s.exp(), log_s, log_t)
            total += float((p * (log_p - log_q)).sum())
    return total / len(prompts)


@pytest.mark.parametrize("loss", [["distillation.distillation_loss.loss_mode=k1"],
                                  ["distillation.distillation_loss.loss_mode=forward_kl_topk",
                                   "distillation.distillation_loss.topk=4",
                                   "distillation.distillation_loss.use_policy_gradient=false"]],
                         ids=["k1", "forward_kl_topk"])
def test_a_student_trained_on_the_teacher_alone_moves_toward_it(task, teacher, tmp_path, loss):
    """No task reward: the exact KL to a fixed teacher of another size (reverse for k1, forward for forward_kl_topk,
    whose top 4 of the 14 tokens hold most but not all of the teacher's mass), on fixed prompts, falls at every one
    of 5 steps (the actor is exported after each)."""
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={tmp_path}",
           "trainer.logger=[file]", "trainer.total_training_steps=5", "trainer.test_freq=-1",
           "trainer.val_before_train=false", "trainer.save_freq=1",
           "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]", "distillation.enabled=true",
           f"distillation.teacher_model.model_path={teacher}", "distillation.distillation_loss.use_task_rewards=false",
           "data.train_batch_size=128", "actor_rollout_ref.actor.ppo_mini_batch_size=128", *loss]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(task["model"])
    texts = [f"{a}->{b}->" for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (9, 0), (2, 7))]
    prompts = prompt_token_ids(tokenizer, [[{"role": "user", "content": t}] for t in texts])
    forward = "topk" in loss[0]
    kl = [first_token_kl(Path(task["model"]), teacher, prompts, forward)]
    kl += [first_token_kl(tmp_path / f"global_step_{step}" / "actor_hf", teacher, prompts, forward)
           for step in range(1, 6)]
    assert kl[0] > 0.5, kl
    assert all(later < earlier for earlier, later in zip(kl, kl[1:])), str(kl)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    metric = "actor/distillation/student_mass" if forward else "actor/distillation/reverse_kl"
    assert all(metric in r and "actor/pg_loss" in r for r in rows)
    if forward:  # the student's mass on the teacher's top 4 grows
        assert rows[-1][metric] > rows[0][metric], [r[metric] for r in rows]


# The real training path (update_policy: global counts over micro batches and DP), one step at lr 0: the loss and the
# gradient norm of the distillation term (and of a straight-through KL loss) are the same for any micro-batch cut and
# for DP 1 and 2.
DISTILL_CUTS = {"micro8": (8, None), "micro1": (1, None), "micro4": (4, None), "dynamic24tokens": (None, 24)}


def distill_step(ckpt: str, micro_batch_size: int | None, max_token_len: int | None) -> dict[str, tuple]:
    from test_loss_aggregation import BATCH, _engine, training_batch

    from shardrl.job.options import PolicyLossOptions, UpdateOptions
    from shardrl.workers.actor import update_policy

    actor = _engine(ckpt, value_head=False)
    layout = actor.layout
    batch = training_batch(ckpt)
    mask = batch.tensors["response_mask"]
    teacher = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) - 2.0
    batch.tensors["teacher_log_probs"] = torch.where(mask.bool(), teacher, math.nan)  # padding holds NaN
    share = batch.take(list(range(layout.dp_rank * BATCH // layout.dp_size,
                                  (layout.dp_rank + 1) * BATCH // layout.dp_size)))
    update = UpdateOptions(mini_batch_size=len(share), micro_batch_size=micro_batch_size, max_token_len=max_token_len)
    out = {}
    for name, distill in (("k1-pg", settings("k1")), ("k3-supervised", settings("k3", policy_gradient=False)),
                          ("k3-with-task", settings("k3", policy_gradient=False, use_task_rewards=True, coef=0.5))):
        metrics = update_policy(actor, share, PolicyLossOptions(clip=ClipRange(0.2), max_response_length=8), update,
                                distillation=distill)
        out[name] = (metrics["distillation/loss"][0], metrics["distillation/reverse_kl"][0], metrics["grad_norm"][0])
    # The KL loss with a straight-through estimator (k3's value, k2's gradient) splits the same way.
    share.tensors["ref_log_probs"] = share.tensors["teacher_log_probs"]
    for kl_type in ("k3+", "low_var_kl"):
        loss = PolicyLossOptions(clip=ClipRange(0.2), max_response_length=8, use_kl_loss=True, kl_loss_coef=0.1,
                                 kl_loss_type=kl_type)
        metrics = update_policy(actor, share, loss, update)
        out[f"kl-{kl_type}"] = (metrics["kl_loss"][0], metrics["pg_loss"][0], metrics["grad_norm"][0])
    return out


@pytest.fixture(scope="module")
def distill_reference(tmp_path_factory):
    from shardrl.models.tiny import make_tiny_checkpoint

    ckpt = str(make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("distill") / "m"))
    return ckpt, distill_step(ckpt, *DISTILL_CUTS["micro8"])


def assert_same(actual: dict, expected: dict, what: str) -> None:
    for name, values in expected.items():
        assert all(math.isfinite(v) for v in values), (name, values)
        assert actual[name] == pytest.approx(values, rel=1e-5, abs=1e-7), f"{what}, {name}"


@pytest.mark.parametrize("cut", ["micro1", "micro4", "dynamic24tokens"])
def test_distillation_is_the_same_for_any_micro_batching(distill_reference, cut):
    ckpt, reference = distill_reference
    assert_same(distill_step(ckpt, *DISTILL_CUTS[cut]), reference, cut)


def test_distillation_is_the_same_at_dp2(distill_reference):
    ckpt, reference = distill_reference
    for rank_result in run_distributed(2, distill_step, ckpt, *DISTILL_CUTS["micro1"]):
        assert_same(rank_result, reference, "DP2")


def test_straight_through_kl_keeps_k3s_value_with_another_gradient(distill_reference):
    _, reference = distill_reference
    (plus_kl, _, plus_norm), (k3_kl, _, k3_norm) = reference["kl-k3+"], reference["kl-low_var_kl"]
    assert plus_kl == pytest.approx(k3_kl, rel=1e-6) and plus_norm != pytest.approx(k3_norm, rel=1e-3)


# forward_kl_topk through the real training path (update_policy, lr 0): its loss, masses and gradient norm are the
# same at any micro-batch cut and at DP2, TP2 (the student's vocab split), CP2 (its tokens split) and PP2.
TOPK_LAYOUTS = {"dp2": dict(), "tp2": dict(tp=2), "cp2": dict(cp=2), "pp2": dict(pp=2)}


def topk_step(ckpt: str, sizes: dict, micro_batch_size: int | None, max_token_len: int | None) -> dict[str, tuple]:
    from test_loss_aggregation import BATCH, training_batch

    from shardrl.job.options import EngineOptions, OptimOptions, PolicyLossOptions, UpdateOptions
    from shardrl.models.config import ModelConfig
    from shardrl.parallel.layout import Layout
    from shardrl.parallel.layout_spec import LayoutSpec
    from shardrl.workers.actor import update_policy
    from shardrl.workers.engine import ModelEngine

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    config = ModelConfig.from_pretrained(ckpt)
    actor = ModelEngine(config, Layout.create(LayoutSpec(world_size=world, **sizes)),
                        EngineOptions(optim=OptimOptions(lr=0.0)), hf_path=ckpt)
    layout = actor.layout
    batch = training_batch(ckpt)
    mask = batch.tensors["response_mask"].bool()
    generator = torch.Generator().manual_seed(5)
    teacher = (torch.randn(*mask.shape, config.vocab_size, generator=generator) * 2).log_softmax(-1).topk(8, dim=-1)
    batch.tensors["teacher_topk_log_probs"] = torch.where(mask[..., None], teacher.values, math.nan)  # padding: NaN
    batch.tensors["teacher_topk_ids"] = teacher.indices.int()
    share = batch.take(list(range(layout.dp_rank * BATCH // layout.dp_size,
                                  (layout.dp_rank + 1) * BATCH // layout.dp_size)))
    update = UpdateOptions(mini_batch_size=len(share), micro_batch_size=micro_batch_size, max_token_len=max_token_len)
    out = {}
    for name, distill in (("supervised", settings("forward_kl_topk", policy_gradient=False, topk=8)),
                          ("pg-clamped", settings("forward_kl_topk", topk=8, log_prob_min_clamp=-4.9))):
        metrics = update_policy(actor, share, PolicyLossOptions(clip=ClipRange(0.2), max_response_length=8), update,
                                distillation=distill)
        out[name] = tuple(metrics[key][0] for key in ("distillation/loss", "distillation/student_mass",
                                                      "distillation/teacher_mass", "distillation/overlap_ratio",
                                                      "distillation/overlap_token_advantage", "grad_norm"))
    return out


@pytest.fixture(scope="module")
def topk_reference(distill_reference):
    ckpt, _ = distill_reference
    return ckpt, topk_step(ckpt, {}, *DISTILL_CUTS["micro8"])


def overlap_reference(ckpt: str) -> tuple[float, float]:
    """verl's overlap_ratio and overlap_token_advantage of topk_step's batch from transformers' full log_softmax of
    the student, against topk_step's teacher top 8."""
    from test_loss_aggregation import training_batch
    from test_parity_matrix import PROMPT, RESPONSE

    t = training_batch(ckpt).tensors
    valid = t["response_mask"].bool()
    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float64)
    with torch.no_grad():
        logits = model(t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]).logits
    student = logits[:, PROMPT - 1:PROMPT - 1 + RESPONSE].log_softmax(-1)  # [B, R, V]
    generator = torch.Generator().manual_seed(5)
    teacher = (torch.randn(*valid.shape, student.shape[-1], generator=generator) * 2).log_softmax(-1).topk(8, dim=-1)
    shared = (teacher.indices[..., :, None] == student.topk(8, dim=-1).indices[..., None, :]).any(-1)  # [B, R, 8]
    terms = teacher.values.double().exp() * (teacher.values.double() - student.gather(-1, teacher.indices))
    count = shared.sum(-1)[valid].double()
    advantage = torch.where(shared, -terms, 0.0).sum(-1)[valid]
    some = count > 0
    return float(count.mean() / 8), float((advantage[some] / count[some]).mean())


def test_forward_kl_topk_is_the_same_for_any_micro_batching(topk_reference):
    ckpt, reference = topk_reference
    assert reference["supervised"][0] > 0.1 and 0 < reference["supervised"][1] < reference["supervised"][2] < 1
    ratio, advantage = overlap_reference(ckpt)
    assert 0 < ratio < 1 and reference["supervised"][3:5] == pytest.approx((ratio, advantage), rel=1e-4)
    for cut in ("micro1", "dynamic24tokens"):
        assert_same(topk_step(ckpt, {}, *DISTILL_CUTS[cut]), reference, cut)


@pytest.mark.parametrize("layout", list(TOPK_LAYOUTS))
def test_forward_kl_topk_is_the_same_at_dp2_tp2_cp2_and_pp2(topk_reference, layout):
    ckpt, reference = topk_reference
    for rank_result in run_distributed(2, topk_step, ckpt, TOPK_LAYOUTS[layout], *DISTILL_CUTS["micro4"]):
        assert_same(rank_result, reference, layout)

