"""Chat-template tokenisation with assistant-only loss masks.

A conversation is rendered with the verifier's own chat template. Assistant spans are found by rendering growing
prefixes of the conversation: the tokens between `template(messages[:i], add_generation_prompt=True)` and
`template(messages[:i+1])` are assistant turn i (its text and its end-of-turn token). This works for any template
whose renderings of prefixes are prefixes of each other, which we check rather than assume.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from models.errors import UserError


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` through the chat template (no extra special tokens: the template has them)."""
    if tokenizer.chat_template is None:
        raise UserError(
            f"the verifier's tokenizer ({tokenizer.name_or_path!r}) has no chat template. Use an instruct/chat model "
            f"or set tokenizer.chat_template before training."
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """The ids the verifier sees before it answers the last user turn."""
    return render(tokenizer, messages, add_generation_prompt=True)


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], max_length: int
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for a full conversation; loss_mask is 1 on assistant tokens only. Truncated to max_length."""
    ids: list[int] = []
    mask: list[int] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        after = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if after[: len(before)] != before or before[: len(ids)] != ids:
            raise UserError(
                f"the chat template of {tokenizer.name_or_path!r} does not render conversation prefixes as prefixes, "
                f"so assistant tokens cannot be located. Use data=selfdistill, or a model with a ChatML-like template."
            )
        mask += [0] * (len(before) - len(ids)) + [1] * (len(after) - len(before))
        ids = after
    return ids[:max_length], mask[:max_length]
