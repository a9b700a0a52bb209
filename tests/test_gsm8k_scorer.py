"""GSM8K number tokens: leading-dot decimals, signs (+, -, Unicode minus), exponents, and tokens that are not numbers
(`--5`, `1.2.3`, `1,23`), which are compared as strings. Every case is written out by hand, in strict and flexible mode.
The everyday cases (commas, `$`, sentence punctuation, 18.00 == 18) are in test_rewards.py."""

import pytest

from shardrl.rewards.gsm8k import compute_score, extract_answer

MINUS = "\u2212"  # the Unicode minus sign
WRONG = 0.25  # format_score: an answer was found but it is wrong; 0.0 means that no answer was found

# (model output, strict answer, flexible answer); numbers come back as str(Decimal), other tokens as written.
EXTRACTIONS = [
    ("The probability is .5", None, "0.5"),
    ("#### .5", "0.5", "0.5"),
    ("#### -.5", "-0.5", "-0.5"),
    ("It costs $.50 each.", None, "0.50"),
    ("Hmm...5", None, "5"),  # an ellipsis is not a decimal point
    ("#### --5", "--5", "--5"),
    ("He had 5 apples, then --5", None, "--5"),  # no fallback to 5 and no -5 read from inside the token
    ("#### +-5", "+-5", "+-5"),
    ("#### 1.2.3", "1.2.3", "1.2.3"),
    ("The version is 1.2.3.", None, "1.2.3"),
    ("#### 1,23", "1,23", "1,23"),  # commas group thousands in threes, else the token is not a number
    (f"The temperature falls to {MINUS}5.", None, "-5"),
    (f"#### {MINUS}5", "-5", "-5"),
    (f"#### ${MINUS}5", "-5", "-5"),
    ("#### +12", "12", "12"),
    ("#### 1e3", "1E+3", "1E+3"),
    ("#### 1.5e-3", "0.0015", "0.0015"),
    (f"#### 1e{MINUS}3", "0.001", "0.001"),
    ("#### 2E+2.", "2E+2", "2E+2"),
    ("#### $$5$$", "5", "5"),  # LaTeX dollars around a number
    ("The eggs cost 3 dollars, 12eggs in all", None, "12"),  # an `e` not followed by digits is no exponent
]


@pytest.mark.parametrize("output, strict, flexible", EXTRACTIONS)
def test_extract_tokens(output, strict, flexible):
    assert extract_answer(output) == strict
    assert extract_answer(output, method="flexible") == flexible


# (model output, ground truth, strict score, flexible score) with format_score=WRONG.
SCORES = [
    ("The probability is .5", "5", 0.0, WRONG),  # .5 is not 5
    ("The probability is .5", "0.5", 0.0, 1.0),
    ("#### .5", "0.5", 1.0, 1.0),
    ("#### .5", "5", WRONG, WRONG),
    ("#### -.5", "-0.5", 1.0, 1.0),
    ("It costs $.50 each.", "0.5", 0.0, 1.0),
    ("#### --5", "-5", WRONG, WRONG),  # not a number: never -5 ...
    ("#### --5", "5", WRONG, WRONG),  # ... nor 5
    ("#### --5", "--5", 1.0, 1.0),  # a string matches only itself
    ("He had 5 apples, then --5", "5", 0.0, WRONG),
    ("He had 5 apples, then --5", "-5", 0.0, WRONG),
    ("#### 1.2.3", "1.2.3", 1.0, 1.0),  # a ground truth that is not a number matches itself
    ("#### 1.2.3", "1.2", WRONG, WRONG),
    ("#### 1.2.3", "3", WRONG, WRONG),
    ("The version is 1.2.3.", "1.2.3", 0.0, 1.0),
    ("#### 1,23", "123", WRONG, WRONG),
    ("#### 1,23", "1,23", 1.0, 1.0),
    (f"The temperature falls to {MINUS}5.", "-5", 0.0, 1.0),
    (f"The temperature falls to {MINUS}5.", "5", 0.0, WRONG),
    (f"#### {MINUS}5", "-5", 1.0, 1.0),
    ("#### -5", f"{MINUS}5", 1.0, 1.0),  # a Unicode minus in the ground truth too
    ("#### +12", "12", 1.0, 1.0),
    ("#### +12", "-12", WRONG, WRONG),
    ("#### 1e3", "1000", 1.0, 1.0),
    ("#### 1e3", "1", WRONG, WRONG),
    ("#### 1e3", "3", WRONG, WRONG),
    ("#### -1e3", "-1000", 1.0, 1.0),
    ("#### 1.5e-3", "0.0015", 1.0, 1.0),
    ("#### 1.8e1", "18", 1.0, 1.0),
    ("The answer is 1,000e3.", "1000000", 0.0, 1.0),
    ("#### $$5$$", "5", 1.0, 1.0),
    ("#### 1.2.3", "1.2.3.", 1.0, 1.0),  # sentence punctuation is dropped from the ground truth as well
    ("#### 12", "12 apples", WRONG, WRONG),  # a number never equals a string
]


@pytest.mark.parametrize("output, truth, strict, flexible", SCORES)
def test_scores(output, truth, strict, flexible):
    assert compute_score(output, truth, format_score=WRONG) == strict
    assert compute_score(output, truth, method="flexible", format_score=WRONG) == flexible
