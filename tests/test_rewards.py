"""GSM8K scorer on realistic model outputs, the data_source registry and custom reward loading."""

from pathlib import Path

import pytest

from shardrl.rewards.gsm8k import TAIL_CHARS, compute_score, extract_answer
from shardrl.rewards.guarded import GuardedScoreFn
from shardrl.rewards.outcomes import RewardFunctionError
from shardrl.rewards.registry import default_compute_score, get_scorer

# (model output, ground truth, strict score, flexible score); expected values written out by hand.
CASES = [
    ("Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
    ("She earns 12/60 = $0.2 per minute, so 0.2 x 50 = $10.\n#### $10", "10", 1.0, 1.0),
    ("The total is 1,234 apples.\n#### 1,234", "1234", 1.0, 1.0),
    ("The total is 1,234 apples.\n#### 1234", "1,234", 1.0, 1.0),  # commas in the ground truth are stripped too
    ("The temperature dropped by 7 degrees, so it is 3 - 10 = -7.\n#### -7", "-7", 1.0, 1.0),
    ("He owes money: the balance is -$5.\n#### -$5", "-5", 1.0, 1.0),
    ("Each share is 7 / 2 = 3.5 dollars.\n#### 3.5", "3.5", 1.0, 1.0),
    ("She pays 18 dollars in total.\n#### 18.00", "18", 1.0, 1.0),  # numeric comparison: 18.00 == 18
    ("First guess: #### 10. Wait, I forgot the tax.\n10 + 2 = 12\n#### 12", "12", 1.0, 1.0),  # last #### wins
    ("First guess: #### 12. Wait, I forgot the tax.\n12 + 2 = 14\n#### 14", "12", 0.0, 0.0),
    ("So the answer is 72.", "72", 0.0, 1.0),  # no ####: strict finds nothing, flexible takes 72
    ("There are 5 boxes with 3 pens each, 15 pens. The answer is 15 pens.", "15", 0.0, 1.0),
    ("#### 72\nI hope this helps! Let me know if you have 2 more questions.", "72", 1.0, 0.0),  # text after answer
    ("#### 72 apples.", "72", 1.0, 1.0),
    ("The answer is #### 36.", "36", 1.0, 1.0),  # sentence-final period is not part of the number
    ("I am not sure how to solve this problem.", "42", 0.0, 0.0),  # no number at all
    ("3 + 4 = 7, then 7 * 6 = 42\n#### 41", "42", 0.0, 0.0),  # wrong answer
    ("He bought 2 shirts at $15.50 each: 2 * 15.50 = 31.\n####31", "31", 1.0, 1.0),  # no space after ####
    ("Total cost is $1,050,000.\n#### $1,050,000", "1050000", 1.0, 1.0),
    ("The ratio is 0.25 and we need 0.1 of it, so 0.025 ... rounding gives\n#### 0.10", "0.1", 1.0, 1.0),
    ("Answer: ####", "5", 0.0, 0.0),  # marker without a number
    ("#### 5\nCheck: 5 + 5 = 10", "5", 1.0, 0.0),  # flexible takes the last number, 10
    ("I think it is 7 but it could be 8.\n#### 8", "7", 0.0, 0.0),
    ("The difference is 20 - 25 = -5 degrees.\n#### $-5", "-5", 1.0, 1.0),
]


@pytest.mark.parametrize("output, truth, strict, flexible", CASES)
def test_gsm8k_strict_and_flexible(output, truth, strict, flexible):
    assert compute_score(output, truth) == strict
    assert compute_score(output, truth, method="flexible") == flexible


def test_extracted_strings_are_normalised():
    assert extract_answer("#### $1,234.50") == "1234.50"
    assert extract_answer("#### -$5") == "-5"
    assert extract_answer("no number here", method="flexible") is None
    assert extract_answer("costs $3, then 4, then 1,000") is None
    assert extract_answer("costs $3, then 4, then 1,000", method="flexible") == "1000"


def test_format_score_and_score_values():
    assert compute_score("#### 41", "42", format_score=0.1) == 0.1  # answer found but wrong
    assert compute_score("nothing", "42", format_score=0.1) == 0.0  # no answer found: not even the format score
    assert compute_score("#### 42", "42", format_score=0.1, score=2.0) == 2.0


def test_only_the_tail_is_searched():
    early_answer = "#### 72\n" + "x" * TAIL_CHARS
    assert compute_score(early_answer, "72") == 0.0
    assert compute_score("x" * 5000 + "\n#### 72", "72") == 1.0


def test_non_numeric_ground_truth_compares_strings():
    assert compute_score("#### 12", "12 apples") == 0.0
    assert compute_score("#### 12", " 12 ") == 1.0


def test_bad_method_is_refused():
    with pytest.raises(ValueError, match="'strict' or 'flexible', got 'loose'"):
        compute_score("#### 1", "1", method="loose")


def test_registry_dispatches_by_data_source():
    assert get_scorer("openai/gsm8k") is compute_score
    assert default_compute_score("openai/gsm8k", "#### 1,000", "1000", {"split": "test"}) == 1.0
    with pytest.raises(LookupError, match="data_source 'my/data'.*custom_reward_function"):
        default_compute_score("my/data", "#### 1", "1")


def test_a_custom_reward_function_loads_in_its_process_and_load_errors_name_it(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text(
        "LIMIT = 3\n"
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(len(solution_str) <= LIMIT), 'length': len(solution_str)}\n"
    )
    with guarded(file, "length_reward") as fn:
        assert fn.score_batch([("d", "abc", None, None)]).scores == [{"score": 1.0, "length": 3}]
    with pytest.raises(RewardFunctionError, match="no such file .*missing.py"):
        guarded(tmp_path / "missing.py", "f")
    with pytest.raises(RewardFunctionError, match="my_reward.py has no attribute 'nope'"):
        guarded(file, "nope")
    with pytest.raises(RewardFunctionError, match="LIMIT is a int, not a function"):
        guarded(file, "LIMIT")


def guarded(path, name: str) -> GuardedScoreFn:
    """The reward function as the trainer runs it: in a process of its own."""
    return GuardedScoreFn(str(path), name, num_workers=1, timeout=30.0, on_error="fail")


def test_format_bonus_reward_example_scores_and_extras():
    """examples/gsm8k/format_bonus_reward.py: 1 correct, 0.1 formatted but wrong, 0 unformatted; extras say which."""
    with guarded(Path(__file__).parents[1] / "examples/gsm8k/format_bonus_reward.py", "compute_score") as fn:
        texts = ["so 3 + 4 = 7\n#### 7", "#### 8", "the answer is 7"]
        assert fn.score_batch([("openai/gsm8k", text, "7", None) for text in texts]).scores == [
            {"score": 1.0, "acc": 1.0, "formatted": 1.0}, {"score": 0.1, "acc": 0.0, "formatted": 1.0},
            {"score": 0.0, "acc": 0.0, "formatted": 0.0}]
