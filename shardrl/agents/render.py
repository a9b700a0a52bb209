"""The environment's side of a token-exact multi-turn trajectory.

The model's turns stay the ids it sampled: decoding and re-encoding them need not give them back (a split the model
sampled that BPE would merge, a merge across a turn boundary), and logprobs belong to the sampled ids. Only what the
environment adds is tokenised: the end of the model's turn when the model did not write it, the tool results or
user turns, and the next assistant header, each written exactly as the chat template writes them.

The template is asked for that text by rendering a reference conversation whose assistant turn is a marker: what
follows the marker is "end of the assistant turn + the new turns + the next header", whatever the template's
delimiters are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardrl.data.chat import prompt_token_ids

# The reference conversation's fixed user turn and assistant content; the marker must survive the template as is
# (no whitespace a template would trim, nothing a model or a user would write).
_REFERENCE_USER = {"role": "user", "content": "Hello."}
_MARKER = "SHARDRL7TURN7MARKER"
_ENV_ROLES = ("tool", "user")
# Probe continuations rendered at construction: the text before the marker must not depend on what follows it.
_PROBES = ([{"role": "tool", "content": "probe result"}],
           [{"role": "user", "content": "probe question"}],
           [{"role": "tool", "content": "first"}, {"role": "tool", "content": "second"}])


class TurnRenderer:
    """Token ids of the first prompt and of each environment turn, for one tokenizer, tool list and template args.

    `tools` are OpenAI function schemas (rendered into the prompt by the template); `template_kwargs` are
    `data.apply_chat_template_kwargs` (e.g. Qwen3's ``enable_thinking=False``), passed to every rendering so the
    environment's next header is the one the first prompt ended with.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict[str, Any]] | None = None,
                 template_kwargs: Mapping[str, Any] = {}) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools or [])
        self.template_kwargs = dict(template_kwargs)
        # Special and added tokens are the only ones the tokenizer never merges with their neighbours, so only one
        # of them can be the first token of the environment's text on its own.
        self._atomic_ids = frozenset(tokenizer.added_tokens_decoder)
        self.prompt_ids([_REFERENCE_USER])  # refuses template_kwargs that shardrl sets itself
        prefixes = {self._render(probe)[0] for probe in _PROBES}
        if len(prefixes) != 1:
            raise ValueError(f"tokenizer {tokenizer.name_or_path}: its chat template renders an assistant turn "
                             f"differently depending on the turns after it, so the environment's turns cannot be "
                             f"rendered on their own; multi-turn rollouts need a template without that dependency")

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first prompt: `messages` rendered with the tools, ending with the assistant header."""
        return prompt_token_ids(self.tokenizer, [messages], {**self.template_kwargs, "tools": self.tools or None})[0]

    def env_ids(self, new_messages: list[dict[str, Any]], last_model_ids: list[int]) -> list[int]:
        """The ids to append after a model turn that ended with `last_model_ids`: the new tool results or user turns,
        between the template's delimiters, up to and including the next assistant header.

        The end of the assistant turn is the template's; when the model's last token is its first token (the model
        stopped on ``<|im_end|>``, say) it is not written twice; otherwise (stopped on a stop string or the length
        limit) the environment writes it, closing the model's turn.
        """
        if not new_messages:
            raise ValueError("env_ids: no new messages; an environment turn adds at least one tool or user message")
        for message in new_messages:
            if message.get("role") not in _ENV_ROLES:
                raise ValueError(f"env_ids: message role {message.get('role')!r} is not an environment turn; "
                                 f"the environment adds only {' or '.join(_ENV_ROLES)} messages")
        return self.rewritten_ids(new_messages, last_model_ids)

    def rewritten_ids(self, messages: list[dict[str, Any]], last_model_ids: list[int]) -> list[int]:
        """As `env_ids`, for messages of any role: what an external agent sent after a model turn when it rewrote the
        history from there (an assistant message the model did not write, a system message). The ids are the
        template's rendering of that text, so they are masked context, never trained on."""
        text = self._render(messages)[1]
        if last_model_ids and last_model_ids[-1] in self._atomic_ids:
            last = self.tokenizer.decode(last_model_ids[-1:])
            if text.startswith(last):
                text = text[len(last):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _render(self, new_messages: list[dict[str, Any]]) -> tuple[str, str]:
        """The reference conversation followed by `new_messages` and the generation header, split around the
        marker: (text before it, text after it)."""
        conversation = [_REFERENCE_USER, {"role": "assistant", "content": _MARKER}, *new_messages]
        text = self.tokenizer.apply_chat_template(conversation, tools=self.tools or None, add_generation_prompt=True,
                                                  tokenize=False, **self.template_kwargs)
        if text.count(_MARKER) != 1:
            raise ValueError(f"tokenizer {self.tokenizer.name_or_path}: its chat template does not write an assistant "
                             f"turn's content exactly once as given ({text.count(_MARKER)} times), so the "
                             f"environment's turns cannot be cut out of it; multi-turn rollouts need such a template")
        before, after = text.split(_MARKER)
        return before, after
