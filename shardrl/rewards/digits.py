"""Scorer of the default job's built-in task (see `shardrl.data.builtin_task`, which names its data source)."""

from __future__ import annotations

from shardrl.data.builtin_task import CALL


ANSWER_WITHOUT_EOS_CREDIT = 0.5  # the right digit followed by anything but EOS: half way there


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response is the right digit and then EOS, `ANSWER_WITHOUT_EOS_CREDIT` when it starts with the
    right digit but goes on, else 0.0 (spaces ignored). The response is decoded without special tokens and the
    built-in tokenizer's only one is EOS, so a response of exactly the digit ended with EOS, or at the length limit:
    with the default `data.max_response_length=2` it has room for the EOS. The credit for the digit alone lets the
    policy learn the answer before it learns to stop, as an untrained one rarely does both."""
    answer = solution_str.strip()
    if answer == str(ground_truth):
        return 1.0
    return ANSWER_WITHOUT_EOS_CREDIT if answer.startswith(str(ground_truth)) else 0.0


LOOKUP_CALL_CREDIT = 0.1  # a tool call that got an answer, wrongly copied: the first step of the skill


def compute_lookup_score(solution_str: str, ground_truth: str) -> float:
    """The multi-turn variant: the model's answer is what follows the first tool response; 1.0 when it starts with
    the secret digit, else `LOOKUP_CALL_CREDIT`. Without a tool response, 0: the answer is reachable only through
    the tool (a guess does not count). The credit makes calling worth learning before copying is: without it the
    first rewards need both at once. A tool response is the tool turn right after the call token (which ends the
    model's turn, so what follows it is the environment's), not tool-turn markers the model wrote itself."""
    _, called, after_call = solution_str.partition(CALL)
    response, closed, answer = after_call.partition("</tool_response>")
    if not (called and closed and response.startswith("<tool_response>")):
        return 0.0
    return 1.0 if answer.strip().startswith(str(ground_truth)) else LOOKUP_CALL_CREDIT
