"""Conversations -> target chat template -> token ids and an assistant-token loss mask.

A drafter learns to predict what the target says, so only assistant tokens are scored. The mask comes from the chat
template itself: the text of every assistant turn is located by rendering the conversation up to that turn (with and
without the generation prompt) and the tokens whose characters fall inside it are marked. This works for any template
that renders a conversation prefix as a prefix of the full text (true of ChatML, Llama-3, Mistral ...), and needs no
``{% generation %}`` markers, which most shipped templates lack.
"""

from __future__ import annotations

import bisect
from typing import Any, Mapping, Sequence

#: ShareGPT speaker names -> chat roles
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "assistant": "assistant",
    "system": "system",
}


def to_messages(record: Mapping[str, Any] | Sequence[Mapping[str, str]],
                require_answer: bool = True) -> list[dict[str, str]]:
    """A ShareGPT record (``{"conversations": [{"from", "value"}, ...]}``) or a list of ``{"role", "content"}``
    messages -> chat messages. Unknown speakers and blank turns are dropped; so are assistant turns before the first
    user turn (the template cannot open with them). Returns ``[]`` when no user -> assistant exchange is left (no user
    turn, with ``require_answer=False``: prompts for ``train regenerate``)."""
    turns = record.get("conversations", []) if isinstance(record, Mapping) else record
    messages: list[dict[str, str]] = []
    for turn in turns or []:
        if not isinstance(turn, Mapping):
            continue
        role = turn.get("role") or SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        content = turn.get("content", turn.get("value"))
        if role not in ("system", "user", "assistant") or not isinstance(content, str) or not content.strip():
            continue
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue
        messages.append({"role": role, "content": content})
    wanted = "assistant" if require_answer else "user"
    return messages if any(m["role"] == wanted for m in messages) else []


def pretokenized(record: Any, max_length: int | None = None,
                 vocab_size: int | None = None) -> tuple[list[int], list[int]] | None:
    """Token ids and assistant mask of a record that carries its own ids (``prompt_ids`` + ``output_ids``, written by
    ``train regenerate``), or None for a text record. The ids are used as they are: re-tokenizing decoded text need
    not give back what the target generated, and the drafter should learn exactly that."""
    if not isinstance(record, Mapping) or "output_ids" not in record:
        return None
    prompt, output = record.get("prompt_ids"), record.get("output_ids")
    for name, value in (("prompt_ids", prompt), ("output_ids", output)):
        if not isinstance(value, list) or not all(isinstance(i, int) and i >= 0 for i in value):
            raise ValueError(f"record {record.get('id')!r}: {name} must be a list of token ids, got "
                             f"{type(value).__name__}.")
    ids = prompt + output
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise ValueError(f"record {record.get('id')!r} holds token id {max(ids)} >= the target's vocabulary "
                         f"({vocab_size}): was it regenerated with another target?")
    mask = [0] * len(prompt) + [1] * len(output)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def tokenize_conversation(
    tokenizer, messages: Sequence[Mapping[str, str]], max_length: int | None = None
) -> tuple[list[int], list[int]]:
    """Chat-templated token ids and a 0/1 mask that is 1 on assistant tokens (their closing tokens included).

    Raises a ValueError when the tokenizer has no chat template, is not a fast tokenizer (character offsets are
    needed) or its template does not render conversation prefixes as text prefixes.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; set tokenizer.chat_template before preparing data.")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("a fast tokenizer (PreTrainedTokenizerFast) is needed: the assistant mask uses offsets.")
    messages = [dict(m) for m in messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    starts, ends = [], []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ValueError(
                "the chat template does not render a conversation prefix as a prefix of the full text, so "
                "assistant tokens cannot be located; use a prefix-consistent template."
            )
        starts.append(len(before))
        ends.append(len(upto))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = []
    for start, _ in encoded["offset_mapping"]:
        span = bisect.bisect_right(starts, start) - 1
        mask.append(int(span >= 0 and start < ends[span]))
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask
