"""Instruction records -> token ids and labels, with the loss only where the model speaks.

Two record shapes (``data.format``):

* ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the
  tokenizer's chat template (``apply_chat_template``; ``data.chat_template`` supplies one
  when the tokenizer has none). With ``loss_on: assistant`` only assistant turns carry
  labels. A template with ``{% generation %}`` markers gives the mask directly
  (``return_assistant_tokens_mask=True``, exactly transformers' mask); for one without,
  the mask is found by rendering the conversation turn by turn: the tokens an assistant
  message adds after the rendered history with its generation prompt are the turn's
  (Note [turn-by-turn masks]).
* ``prompt_completion``: ``{"prompt": ..., "completion": ...}``, both strings or both
  message lists. Strings: ``tokenizer(prompt)`` then ``completion`` without special
  tokens, then EOS; messages: the prompt rendered with its generation prompt, then the
  rest of ``prompt + completion``. With ``loss_on: assistant`` the labels cover the
  completion only.

Labels are unshifted (the Hugging Face convention): ``labels[t] = ids[t]`` where trained,
``IGNORE_INDEX`` elsewhere. Every problem raises InstructError naming the record's file
and line (or row) and what to change.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

from roundpipe.coordinator.spec.errors import host_shortage
from roundpipe.coordinator.spec.sources import is_unicode_text
from roundpipe.shared.model import IGNORE_INDEX

__all__ = [
    "InstructError",
    "has_generation_markers",
    "load_chat_template",
    "render_chat",
    "render_prompt_completion",
]

_GENERATION_RE = re.compile(r"{%-?\s*generation\s*-?%}")


class InstructError(ValueError):
    """An instruction record cannot be rendered; the message names where and the fix."""


def has_generation_markers(template: str | dict[str, str] | None) -> bool:
    """Whether the template (or the default of a tokenizer's named templates) marks the
    assistant's tokens with ``{% generation %}``."""
    if isinstance(template, dict):
        template = template.get("default")
    return isinstance(template, str) and _GENERATION_RE.search(template) is not None


def load_chat_template(tokenizer: Any, path: str | None) -> None:
    """Give ``tokenizer`` the template in file ``path`` (if any); InstructError if it
    ends up with none."""
    if path is not None:
        try:
            with open(path, encoding="utf-8-sig") as f:  # without a byte-order mark
                tokenizer.chat_template = f.read()
        except UnicodeDecodeError as exc:
            raise InstructError(
                f"chat template {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                f"at offset {exc.start})"
            ) from None
        except OSError as exc:
            if host_shortage(exc) is not None:
                raise  # the host's shortage, not the file's: the job pauses (spec.errors)
            raise InstructError(f"cannot read chat template {path}: {exc.strerror}") from None
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise InstructError(
            f"{name} has no chat template; set data.chat_template to a Jinja template file "
            "(roundpipe/demo_data/chat_template.jinja is one)"
        )


def _check_messages(messages: Any, where: str, field: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InstructError(
            f"{where}: {field!r} must be a non-empty list of {{'role', 'content'}} messages, "
            f"got {type(messages).__name__}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InstructError(
                f"{where}: {field}[{i}] must be an object with a string 'role' (and "
                f"'content'), got {m!r:.80}"
            )
        if "content" not in m:
            raise InstructError(f"{where}: {field}[{i}] ({m['role']}) has no 'content'")
        if not all(is_unicode_text(text) for text in _strings(m)):
            # else the tokenizer's TypeError blamed the chat template (any field a
            # template renders: content or its parts, name, tool-call arguments, ...)
            raise InstructError(
                f"{where}: {field}[{i}] ({m['role']}) holds an unpaired UTF-16 surrogate "
                "(a broken \\ud83d-style escape); fix or drop the record"
            )
    return messages


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value (keys too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], where: str, *, tokenize: bool = True, **kw: Any
) -> Any:
    """``messages`` through the chat template: its encoding, or with ``tokenize=False``
    its text (which ``_tokens`` turns into the same ids)."""
    try:
        if not tokenize:
            return tokenizer.apply_chat_template(messages, tokenize=False, **kw)
        # (verbose=False: a record longer than the tokenizer's model_max_length is cut to
        # data.seq_len, not fed whole; the warning would only mislead)
        return tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, tokenizer_kwargs={"verbose": False}, **kw
        )
    except Exception as exc:  # jinja2's TemplateError (raise_exception), TypeError, ...
        roles = ", ".join(sorted({str(m.get("role")) for m in messages}))
        raise InstructError(
            f"{where}: the chat template rejects this conversation (roles: {roles}): "
            f"{' '.join(str(exc).split())}; fix the record or use a template that accepts it"
        ) from None


def _ids(enc: Any) -> list[int]:
    return [int(t) for t in enc["input_ids"]]


def _tokens(tokenizer: Any, text: str) -> list[int]:
    """``text`` (a rendered chat, or a piece of one) tokenised as ``apply_chat_template``
    tokenises its rendering."""
    return _ids(tokenizer(text, add_special_tokens=False, verbose=False))


def render_chat(
    tokenizer: Any,
    messages: Any,
    where: str,
    *,
    loss_on: str = "assistant",
    field: str = "messages",
) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of one conversation. Note the module docstring for the mask."""
    messages = _check_messages(messages, where, field)
    if loss_on == "all":
        ids = _ids(_render(tokenizer, messages, where))
        return ids, list(ids)
    if not any(m["role"] == "assistant" for m in messages):
        raise InstructError(
            f"{where}: the conversation has no assistant turn, so nothing would be trained "
            "(with data.loss_on: assistant); add one, drop the record, or set data.loss_on: all"
        )
    if has_generation_markers(tokenizer.chat_template):
        enc = _render(tokenizer, messages, where, return_assistant_tokens_mask=True)
        ids = _ids(enc)
        mask = enc["assistant_masks"]
    else:
        ids, mask = _turn_by_turn_mask(tokenizer, messages, where)
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    if all(y == IGNORE_INDEX for y in labels):
        raise InstructError(
            f"{where}: the chat template renders no assistant tokens (empty assistant "
            "content?); fix the record or set data.loss_on: all"
        )
    return ids, labels


# Note [turn-by-turn masks]
# A template without {% generation %} markers says nothing of where a turn's tokens are,
# so they are found by rendering: the assistant turn i is what the conversation's first
# i + 1 messages add to its first i rendered with the generation prompt (the header that
# opens an assistant turn), provided the template renders turn by turn: each of those
# renderings is a prefix of the next. This gives each assistant turn a span of the
# text's characters, as the markers do, and its tokens are the whole text's tokens in
# that span. To find them the text is tokenised once, as its pieces between the spans'
# edges: where the pieces' tokens, put end to end, are the whole text's tokens, every
# edge falls between two tokens and each token is its piece's. The prefixes are rendered
# as text only (the template alone is cheap).
#
# The rule used before tokenised every prefix and took the tokens it added: time
# quadratic in the turns (2.2 s for one 200-turn record of 28K tokens; hours for a set
# of agent traces). Where that rule accepts a record the two agree (a prefix whose
# tokens begin the whole's spells its characters with the same tokens). It also refused
# records whose prefix, tokenised alone, merges across its own end what the whole text
# keeps apart (" " and "\n" into " \n", with nothing after the prefix to split them):
# a token the model never sees; these are masked by their spans now. Where a token of
# the whole text straddles an edge, or the texts are not prefixes of each other, the
# rule on tokens decides, at its cost (``_turn_by_turn_mask_by_tokens``), and names the
# record if it fails.


def _turn_by_turn_mask(
    tokenizer: Any, messages: list[dict[str, Any]], where: str
) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of a conversation whose template has no generation markers: Note
    [turn-by-turn masks]."""
    text = _render(tokenizer, messages, where, tokenize=False)
    edges = [0]
    turns = set()  # which pieces (between consecutive edges) are assistant turns
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise _opens_with_assistant(where)
        before = _render(tokenizer, messages[:i], where, tokenize=False, add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], where, tokenize=False)
        if not (upto.startswith(before) and text.startswith(upto) and len(before) >= edges[-1]):
            # the definition on tokens decides (and names the record if it fails)
            return _turn_by_turn_mask_by_tokens(tokenizer, messages, where)
        turns.add(len(edges))
        edges += [len(before), len(upto)]
    edges.append(len(text))
    ids: list[int] = []
    mask: list[int] = []
    for piece, (a, b) in enumerate(zip(edges, edges[1:])):
        tokens = _tokens(tokenizer, text[a:b]) if b > a else []
        ids += tokens
        mask += [int(piece in turns)] * len(tokens)
    if ids != _tokens(tokenizer, text):  # a token straddles an edge
        return _turn_by_turn_mask_by_tokens(tokenizer, messages, where)
    return ids, mask


def _turn_by_turn_mask_by_tokens(
    tokenizer: Any, messages: list[dict[str, Any]], where: str
) -> tuple[list[int], list[int]]:
    """``_turn_by_turn_mask`` by its definition on tokens: a tokenisation of every
    prefix, for a conversation the pieces cannot settle."""
    ids = _ids(_render(tokenizer, messages, where))
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise _opens_with_assistant(where)
        before = _ids(_render(tokenizer, messages[:i], where, add_generation_prompt=True))
        upto = _ids(_render(tokenizer, messages[: i + 1], where))
        if upto[: len(before)] != before or ids[: len(upto)] != upto:
            raise _not_turn_by_turn(where)
        for t in range(len(before), len(upto)):
            mask[t] = 1
    return ids, mask


def _opens_with_assistant(where: str) -> InstructError:
    # nothing before the turn to render: where its tokens start is unknown
    return InstructError(
        f"{where}: the conversation opens with an assistant turn, whose tokens "
        "this chat template cannot locate (it has no {% generation %} markers); "
        "use a template with them (data.chat_template), data.loss_on: all, or "
        "drop the record"
    )


def _not_turn_by_turn(where: str) -> InstructError:
    return InstructError(
        f"{where}: the chat template does not render this conversation turn by "
        "turn (an earlier turn changes once later ones follow), so the assistant "
        "tokens cannot be found; use a template with {% generation %} markers "
        "(data.chat_template) or data.loss_on: all"
    )


def render_prompt_completion(
    tokenizer: Any,
    prompt: Any,
    completion: Any,
    where: str,
    *,
    loss_on: str = "assistant",
    eos_token_id: int | None = None,
    fields: Sequence[str] = ("prompt", "completion"),
) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of one prompt/completion pair; labels on the completion only
    (or everything with ``loss_on: all``)."""
    pf, cf = fields
    if isinstance(prompt, str) and isinstance(completion, str):
        for name, text in ((pf, prompt), (cf, completion)):
            if not is_unicode_text(text):
                raise InstructError(
                    f"{where}: field {name!r} holds an unpaired UTF-16 surrogate (a broken "
                    "\\ud83d-style escape); fix or drop the record"
                )
        head = [int(t) for t in tokenizer([prompt], verbose=False)["input_ids"][0]]
        tail = [
            int(t)
            for t in tokenizer([completion], add_special_tokens=False, verbose=False)["input_ids"][
                0
            ]
        ]
        if not completion.strip():
            # checked before EOS is appended: "prompt -> EOS" is no answer to train
            raise InstructError(
                f"{where}: the completion is empty (or only whitespace); nothing would be "
                "trained; fix or drop the record"
            )
        if eos_token_id is None:  # the model would never learn to stop
            raise InstructError(
                f"{where}: the tokenizer has no EOS token, which ends each completion; use "
                "a tokenizer that has one (or give prompt and completion as messages, "
                "which its chat template ends)"
            )
        if not tail or tail[-1] != eos_token_id:
            tail.append(eos_token_id)
        ids = head + tail
    elif isinstance(prompt, list) and isinstance(completion, list):
        load_chat_template(tokenizer, None)  # a clear error if the tokenizer has none
        p = _check_messages(prompt, where, pf)
        c = _check_messages(completion, where, cf)
        head = _ids(_render(tokenizer, p, where, add_generation_prompt=True))
        ids = _ids(_render(tokenizer, p + c, where))
        if ids[: len(head)] != head:
            raise InstructError(
                f"{where}: the chat template renders the prompt differently once the "
                "completion follows, so the completion's tokens cannot be found; use a "
                "template that renders turn by turn, or data.loss_on: all"
            )
    else:
        raise InstructError(
            f"{where}: {pf!r} and {cf!r} must both be strings or both be message lists, got "
            f"{type(prompt).__name__} and {type(completion).__name__}"
        )
    if len(ids) == len(head):
        raise InstructError(f"{where}: the completion is empty; nothing would be trained")
    if loss_on == "all":
        return ids, list(ids)
    return ids, [IGNORE_INDEX] * len(head) + ids[len(head) :]
