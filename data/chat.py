"""Chat-template tokenisation with assistant-only loss masks.

A conversation is rendered with the verifier's own chat template. Assistant spans are found by rendering growing
prefixes of the conversation: the tokens between `template(messages[:i], add_generation_prompt=True)` and
`template(messages[:i+1])` are assistant turn i (its text and its end-of-turn token).

Where renderings of prefixes are prefixes of each other (ChatML, Llama 3, SmolLM2...), a conversation is one row
with every assistant turn in its mask. Reasoning templates break that: Qwen3-style templates drop the `<think>`
block of every assistant turn before the last user turn, so turn 1 reads differently once turn 2 exists. Then a
conversation becomes one row per assistant turn, each exactly what the verifier sees when it writes that turn
(earlier turns as the template renders them, without their reasoning), its mask on that turn only (`encode_turns`).

Reasoning blocks inside assistant spans are trained on (`reasoning=train`) or kept as context with loss 0
(`reasoning=mask`, `mask_reasoning`): they are located by their tags in the tokens' text, so this works whether the
tokenizer has the tags as special tokens or splits them.

A base model has no chat template: with `rendering=plain` (the verifier's setting, models/verifiers/embedded.py) a
conversation is plain text the model continues: its messages' contents in order, PLAIN_SEPARATOR between them and
after the last when the model is to answer (`plain_ids`). Each piece is tokenised on its own and the ids joined (the
first with the tokenizer's own special tokens, <bos> for Gemma), so a prefix of a conversation renders to a prefix of
its ids and an answer's mask covers exactly its text. Asking for `chat` of a tokenizer without a template is an error.

Message content is text, never control: a `<|im_start|>system` typed inside a prompt or an answer is tokenised as the
characters it is, not as the template's control tokens (`encode_rendered`), so it opens no turn and bounds no loss
mask. A conversation without such text tokenises exactly as the whole rendered text always did.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

from runtime.errors import UserError


def control_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The tokenizer's special tokens as text (`<|im_start|>`, `<|im_end|>`...), longest first: what only the
    template may write."""
    return sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content},
                  key=len, reverse=True)


def encode_rendered(tokenizer: PreTrainedTokenizerBase, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """Token ids of a rendered `text` whose `spans` (start, end) are message content: control tokens outside them
    are the template's (one id each), inside them plain text (`split_special_tokens`). The text is cut at the
    template's control tokens only, where the tokenizer cuts it anyway, so a text whose spans hold no control token
    gets the ids of `tokenizer(text)`."""
    specials = control_tokens(tokenizer)
    if not specials or not any(s in text[a:b] for a, b in spans for s in specials):
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    masked = list(text)
    for a, b in spans:  # content blanked: the template's own control tokens are found outside it only
        masked[a:b] = "\0" * (b - a)
    ids: list[int] = []
    pos = 0
    for m in re.finditer("|".join(map(re.escape, specials)), "".join(masked)):
        if m.start() > pos:
            ids += tokenizer(text[pos:m.start()], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        ids += tokenizer(m.group(), add_special_tokens=False)["input_ids"]
        pos = m.end()
    if pos < len(text):
        ids += tokenizer(text[pos:], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


SENTINEL = "\ue000specdraft-content-{}\ue001"  # private-use characters: in no template, no message


def content_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool,
                  text: str, where: str) -> list[tuple[int, int]]:
    """Where each message's content lies in `text` (the rendering of `messages`): the template rendered again with
    a sentinel for each content must give `text` back once the sentinels are replaced. A template that changes
    content (trims it, drops reasoning) does not: a content holding a control token is then refused, naming it."""
    contents = [m.get("content") if isinstance(m.get("content"), str) else None for m in messages]
    marked = [dict(m, content=SENTINEL.format(j)) if c is not None else m
              for j, (m, c) in enumerate(zip(messages, contents))]
    probe = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=add_generation_prompt)
    found = sorted((probe.find(SENTINEL.format(j)), j) for j, c in enumerate(contents) if c is not None)
    spans, out, pos, shift = [], [], 0, 0
    ok = all(probe.count(SENTINEL.format(j)) == 1 for _, j in found) and all(at >= 0 for at, _ in found)
    if ok:
        for at, j in found:
            out.append(probe[pos:at] + contents[j])
            spans.append((at + shift, at + shift + len(contents[j])))
            shift += len(contents[j]) - len(SENTINEL.format(j))
            pos = at + len(SENTINEL.format(j))
        ok = "".join(out) + probe[pos:] == text
    if not ok:
        specials = control_tokens(tokenizer)
        j, tok = next((j, s) for j, c in enumerate(contents) for s in specials if c and s in c)
        raise UserError(f"{where}, message {j} ({messages[j].get('role')}): its content holds the control token "
                        f"{tok!r}, and the chat template of {tokenizer.name_or_path!r} does not show content verbatim, "
                        f"so it cannot be kept as text. Remove {tok!r} from that message.")
    return spans


RENDERINGS = ("chat", "plain")
PLAIN_SEPARATOR = "\n\n"  # between messages in plain rendering, and before the text the model writes


def plain_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
              add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` as plain text (a base model's rendering): the contents joined by PLAIN_SEPARATOR,
    followed by it when the model answers next. Pieces are tokenised apart, the first with the tokenizer's special
    tokens (its <bos>), content as text (`split_special_tokens`: a `<eos>` typed in a message is characters)."""
    ids: list[int] = []
    texts = [m["content"] if isinstance(m.get("content"), str) else "" for m in messages]
    pieces = [p for j, t in enumerate(texts)
              for p in ([PLAIN_SEPARATOR] if j else []) + [t]] + ([PLAIN_SEPARATOR] if add_generation_prompt else [])
    for j, piece in enumerate(pieces):
        ids += tokenizer(piece, add_special_tokens=j == 0, split_special_tokens=True)["input_ids"]
    return ids


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool,
           where: str = "conversation", rendering: str = "chat") -> list[int]:
    """Token ids of `messages` through the chat template (no extra special tokens: the template has them), or as
    plain text with `rendering=plain` (`plain_ids`). Control tokens written inside a message's content stay text
    (`encode_rendered`); `where` names the conversation in the error for a template that does not show content
    verbatim."""
    if rendering == "plain":
        return plain_ids(tokenizer, messages, add_generation_prompt)
    if rendering != "chat":
        raise UserError(f"rendering={rendering!r} is not one of {list(RENDERINGS)}.")
    if tokenizer.chat_template is None:
        raise UserError(
            f"the verifier's tokenizer ({tokenizer.name_or_path!r}) has no chat template, and chat rendering was "
            f"asked of it: it is a base model. Render plain text instead (verifier.rendering=plain, what "
            f"verifier=gemma3 sets), or use an instruct/chat model."
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    specials = control_tokens(tokenizer)
    if not any(isinstance(m.get("content"), str) and s in m["content"] for m in messages for s in specials):
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # nothing to keep apart: the ids as always
    return encode_rendered(tokenizer, text, content_spans(tokenizer, messages, add_generation_prompt, text, where))


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
               rendering: str = "chat") -> list[int]:
    """The ids the verifier sees before it answers the last user turn (`rendering`: the verifier's, chat or plain)."""
    return render(tokenizer, messages, add_generation_prompt=True, rendering=rendering)


ROLES = ("system", "user", "assistant", "tool")
REASONING = ("train", "mask")
TAGS = ("<think>", "</think>")


def check_messages(messages: list[dict[str, str]], where: str) -> None:
    """Refuse a conversation with a role the chat templates do not know, or without an assistant turn to train on."""
    for j, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise UserError(f"{where}, message {j}: unknown role {m.get('role')!r}; expected one of {list(ROLES)}. "
                            f"Rename the role in the data (ShareGPT files: \"from\": \"human\" / \"gpt\").")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no assistant turn, so there is nothing to train on as it is. "
                        f"Give conversations with answers, or let the verifier answer the prompts (data=selfdistill).")


def encode_turns(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], max_length: int,
                 where: str = "conversation", rendering: str = "chat") -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) rows for a conversation with assistant turns, loss 1 on assistant tokens only: one row
    when the template renders prefixes as prefixes (plain rendering always does), else one row per assistant turn
    (see the module doc). Each row is truncated to max_length."""
    check_messages(messages, where)
    try:
        return [encode_conversation(tokenizer, messages, max_length, where, rendering)]
    except NotPrefixes:
        pass
    rows = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, where=where, rendering=rendering)
        after = render(tokenizer, messages[: i + 1], add_generation_prompt=False, where=where, rendering=rendering)
        if after[: len(before)] != before:
            raise NotPrefixes(f"the chat template of {tokenizer.name_or_path!r} renders assistant turn {i} of {where} "
                              f"in a way that does not extend the prompt before it, so its tokens cannot be located. "
                              f"Use data=selfdistill, or a model with a ChatML-like template.")
        rows.append((after[:max_length], ([0] * len(before) + [1] * (len(after) - len(before)))[:max_length]))
    return rows


def mask_reasoning(tokenizer: PreTrainedTokenizerBase, ids: list[int], mask: list[int],
                   tags: tuple[str, str] = TAGS) -> list[int]:
    """`mask` with every reasoning block inside an assistant span (from its opening tag through its closing tag, or
    to the span's end when it never closes) set to 0. Tags are found in the concatenated text of the span's tokens,
    so a tag that is one special token and a tag split over several are found alike."""
    out = list(mask)
    open_tag, close_tag = tags
    j = 0
    while j < len(mask):
        if not mask[j]:
            j += 1
            continue
        end = j
        while end < len(mask) and mask[end]:
            end += 1
        pieces = [tokenizer.decode([t]) for t in ids[j:end]]
        bounds = [0]
        for piece in pieces:
            bounds.append(bounds[-1] + len(piece))
        text = "".join(pieces)
        at = text.find(open_tag)
        while at >= 0:
            close = text.find(close_tag, at + len(open_tag))
            stop = len(text) if close < 0 else close + len(close_tag)
            for k in range(end - j):
                if bounds[k] < stop and bounds[k + 1] > at:  # the token overlaps the block
                    out[j + k] = 0
            at = text.find(open_tag, stop) if close >= 0 else -1
        j = end
    return out


def rewrites_earlier_turns(tokenizer: PreTrainedTokenizerBase, tags: tuple[str, str] = TAGS) -> bool:
    """Whether the template renders an assistant turn differently once a later user turn follows (Qwen3-style
    templates drop its reasoning block): then a conversation's ids cannot be extended turn by turn."""
    turn = [{"role": "user", "content": "a"}, {"role": "assistant", "content": f"{tags[0]}\nr\n{tags[1]}\n\nb"}]
    alone = render(tokenizer, turn, add_generation_prompt=False)
    followed = render(tokenizer, turn + [{"role": "user", "content": "c"}], add_generation_prompt=True)
    return followed[: len(alone)] != alone


class NotPrefixes(UserError):
    """The template does not render a conversation's prefixes as prefixes."""


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], max_length: int, where: str = "conversation",
    rendering: str = "chat",
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for a full conversation; loss_mask is 1 on assistant tokens only. Truncated to
    max_length."""
    ids: list[int] = []
    mask: list[int] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, where=where, rendering=rendering)
        after = render(tokenizer, messages[: i + 1], add_generation_prompt=False, where=where, rendering=rendering)
        if after[: len(before)] != before or before[: len(ids)] != ids:
            raise NotPrefixes(
                f"the chat template of {tokenizer.name_or_path!r} does not render conversation prefixes as prefixes, "
                f"so assistant tokens cannot be located in one row. Use data=selfdistill, or a model with a "
                f"ChatML-like template (data.chat.encode_turns splits such conversations into one row per "
                f"assistant turn)."
            )
        mask += [0] * (len(before) - len(ids)) + [1] * (len(after) - len(before))
        ids = after
    return ids[:max_length], mask[:max_length]
