"""Scoring while generating (`reward_model.use_reward_loop`, reward_loop.py): the synchronous step streams its
samples out of the engine and scores each as it finishes, so that with a slow reward function only the samples
finishing last are scored after generation; the batch trained on is the one the whole-batch path scores."""

import json
import subprocess
import sys
import threading

import pytest
import torch

from shardrl.data.batch import Batch, as_object_array
from shardrl.rewards.manager import SampleScores
from shardrl.rewards.outcomes import RewardFunctionError
from shardrl.trainer.reward_loop import ScoringThread
from shardrl.trainer.tracking import Timeline

SLOW_REWARD = '''
import json
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    start = time.time()
    time.sleep(0.05)
    with open(LOG, "a") as f:
        f.write(json.dumps({"start": start, "end": time.time()}) + "\\n")
    return {"score": float(solution_str.strip().startswith(str(ground_truth))), "length": len(solution_str)}
'''
# Waves: 128 samples of up to 32 tokens through 8 engine slots, so samples finish all through generation; 4 reward
# processes score up to 32 samples at once.
SAMPLES = 128
JOB = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
       "data.max_response_length=32", "data.train_batch_size=32", "actor_rollout_ref.rollout.n=4",
       "actor_rollout_ref.rollout.max_num_seqs=8", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
       "custom_reward_function.num_workers=4"]
LOOP = "reward_model.use_reward_loop=true"
TIMING = ("timing_s/", "perf/throughput", "sync/gbps", "sync/seconds")


def run(tmp_path, name, *overrides):
    log = tmp_path / f"{name}.jsonl"
    reward = tmp_path / "slow_reward.py"
    reward.write_text(f"LOG = {str(log)!r}\n" + SLOW_REWARD)
    cmd = [sys.executable, "-m", "shardrl.trainer.main_ppo", f"trainer.default_local_dir={tmp_path / name}",
           "trainer.logger=[file]", f"custom_reward_function.path={reward}", *JOB, *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return rows, calls


@pytest.mark.slow  # 43 s; the fully-async job below and the unit tests keep the loop in the default suite
def test_scoring_while_generating_hides_a_slow_reward_function_and_trains_the_same_batch(tmp_path):
    overlapped, calls = run(tmp_path, "overlapped", LOOP)
    whole, _ = run(tmp_path, "whole")
    assert len(calls) == 2 * SAMPLES and all(c["end"] - c["start"] >= 0.05 for c in calls)
    for row in overlapped:
        # exposed (the wait for scores after generation) against the scorer's time in all, from the timeline's
        # spans, and against the samples' scoring time summed one by one (each call sleeps 50 ms)
        exposed, scoring = row["timing_s/reward"], row["timing_s/score"]
        assert exposed <= scoring / 5 and exposed <= SAMPLES * 0.05 / 5, row
        assert scoring - row["timing_s/reward_hidden"] <= exposed + 0.01  # what generation did not hide it waited for
    # The whole batch after generation: its wait is all of its scoring, at most 32 samples at once.
    assert all(row["timing_s/reward"] >= SAMPLES * 0.05 / 32 for row in whole)
    assert "timing_s/reward_hidden" not in whole[0]
    # Same seeds, same samples, same order: every number but the timings is the same.
    for a, b in zip(overlapped, whole):
        keys = {k for k in b if not k.startswith(TIMING)}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    assert "reward_extra/length/mean" in overlapped[0]


def chunk(seeds, scores, extras):
    batch = Batch({"sample_seed": torch.tensor(seeds), "token_level_scores": torch.tensor(scores)[:, None]},
                  {"name": as_object_array([f"s{seed}" for seed in seeds])})
    return batch, SampleScores(torch.tensor(scores)[:, None], torch.tensor(scores), extras | {})


def test_the_scored_chunks_come_back_in_row_order_with_their_extras():
    chunks = {7: chunk([7, 2], [0.7, 0.2], {"acc": [1, 0]}), 5: chunk([5], [0.5], {}),
              0: chunk([0, 9], [0.0, 0.9], {"acc": [0, 1], "len": [3, 4]})}
    order = iter([7, 5, 0])
    scoring = ScoringThread(lambda samples: chunks[int(samples.tensors["sample_seed"][0])], Timeline(), lambda: 3)
    for first in order:
        scoring.submit(chunks[first][0])
        while scoring.waiting:  # one chunk per scorer call, so the test knows what each call gets
            pass
    batch, scores, metrics = scoring.finish()
    assert batch.tensors["sample_seed"].tolist() == [0, 2, 5, 7, 9]
    assert batch.non_tensors["name"].tolist() == ["s0", "s2", "s5", "s7", "s9"]
    assert scores.scores.tolist() == pytest.approx([0.0, 0.2, 0.5, 0.7, 0.9])
    assert scores.token_level[:, 0].tolist() == pytest.approx([0.0, 0.2, 0.5, 0.7, 0.9])
    assert scores.extras == {"acc": [0, 0, None, 1, 1], "len": [3, None, None, None, 4]}
    assert metrics["timing_s/reward_hidden"] >= 0


def test_a_scorer_error_reaches_the_trainer_thread_as_it_was():
    failed = threading.Event()

    def score(samples):
        failed.set()
        raise RewardFunctionError("reward function f.py:compute_score failed on sample 3: boom")

    scoring = ScoringThread(score, Timeline(), lambda: 0)
    scoring.submit(chunk([1], [1.0], {})[0])
    failed.wait(10)
    with pytest.raises(RewardFunctionError, match="failed on sample 3: boom"):
        scoring.finish()
    scoring.close()


def test_fully_async_scores_each_group_as_it_finishes_not_after_the_trainer_takes_it(tmp_path):
    rows, calls = run(tmp_path, "async", LOOP, "--config-name=fully_async_ppo_trainer")
    assert [r["step"] for r in rows] == [1, 2] and len(calls) >= 2 * SAMPLES
    assert all("timing_s/reward" not in r for r in rows)  # the trainer never waited on a scorer of its own
    assert sum(r.get("timing_s/score", 0.0) for r in rows) >= 0.05  # the rollouter's scoring thread's spans
    assert all("reward_extra/length/mean" in r and 0 <= r["critic/score/mean"] <= 1 for r in rows)
