"""The assistant turns of a conversation, located in its FULL rendering by the chat template.

Labels are taken from the rendering the model trains on — the whole conversation rendered once,
exactly as the template renders it — never from renderings of prefixes: templates such as
Qwen3.5's rewrite history (the reasoning of an assistant turn is dropped once a later user
query follows; only the turns after the last query keep ``<think>…</think>``), so a prefix's
rendering is not a prefix of the whole.

The templates handled are ChatML's family (Qwen's among them): every turn is
``<|im_start|>{role}\\n … <|im_end|>``, and the k-th ``<|im_start|>assistant\\n`` of the
rendering opens the k-th assistant message (tool results render as ``user`` turns, the system
prompt as ``system``). What the model generates in an assistant turn is everything after that
header up to and including its ``<|im_end|>`` — minus what the template's generation prompt
already supplies after the header (Qwen3.5: ``<think>\\n`` with thinking on,
``<think>\\n\\n</think>\\n\\n`` with ``enable_thinking: false``), which is never labelled because
the model never generates it; the newline after ``<|im_end|>`` belongs to the template.

Exactness is checked, not assumed: the template's generation prompt must open a ChatML assistant
turn, there must be exactly one assistant header per assistant message, each turn must end
with ``<|im_end|>``, and each turn's answer text and every tool call's function name must lie
inside its span; message text may not contain
the ChatML markers (they would forge turns). Anything else is refused with the reason
(:class:`~qwen35_trainer.data.batch.DataError` for a row, ``ValueError`` for a template).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qwen35_trainer.data.batch import DataError

__all__ = ["ASSISTANT_HEADER", "TURN_END", "TemplateShape", "assistant_spans", "template_shape"]

TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
ASSISTANT_HEADER = TURN_START + "assistant\n"
_PROBE = [{"role": "user", "content": "hi"}]


@dataclasses.dataclass(frozen=True)
class TemplateShape:
    """What the template's generation prompt adds after the assistant header (never
    labelled)."""

    generation_tail: str


def template_shape(render: Callable[..., str], kwargs: dict[str, Any], name: str) -> TemplateShape:
    """The shape of the chat template ``render`` (``apply_chat_template``) under ``kwargs``;
    ``ValueError`` naming ``name`` when its assistant turns cannot be located exactly."""
    try:
        plain = render(_PROBE, tokenize=False, **kwargs)
        prompted = render(_PROBE, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as err:  # jinja's and the template's own exceptions
        raise ValueError(f"{name}: the chat template cannot render a user turn: {err}") from err
    tail = prompted[len(plain) :]
    if not prompted.startswith(plain) or not tail.startswith(ASSISTANT_HEADER):
        raise ValueError(
            f"{name}: the chat template's generation prompt {tail!r} does not open a ChatML "
            f"assistant turn ({ASSISTANT_HEADER!r}), so its assistant turns cannot be located "
            "exactly in a rendering (supported: ChatML templates such as Qwen's)"
        )
    return TemplateShape(generation_tail=tail[len(ASSISTANT_HEADER) :])


def _texts(message: dict) -> list[str]:
    """Every string a message carries (content parts, reasoning, tool call names and arguments)."""
    content = message.get("content")
    out = (
        [content]
        if isinstance(content, str)
        else [p.get("text", "") for p in content or () if p.get("type") == "text"]
    )
    out.append(message.get("reasoning_content") or "")
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        out += [function.get("name", ""), str(function.get("arguments", ""))]
    return out


def _answer(message: dict) -> str:
    """The assistant message's answer text as templates render it: after an inline
    ``</think>``, trimmed."""
    texts = _texts({"content": message.get("content")})
    return "".join(texts).split("</think>")[-1].strip()


def assistant_spans(
    whole: str, messages: list[dict], shape: TemplateShape, train_on: str, where: str
) -> list[tuple[int, int]]:
    """The character spans of ``whole`` (the rendering of ``messages``) to label: per assistant
    message (``train_on: assistant``) or per assistant message after the last user query
    (``last_assistant``), from after the header and the generation prompt's own tokens to the
    end of its ``<|im_end|>``, in order."""
    for i, message in enumerate(messages):
        if any(marker in text for text in _texts(message) for marker in (TURN_START, TURN_END)):
            raise DataError(
                f"{where}: messages[{i}] contains a ChatML marker ({TURN_START} or "
                f"{TURN_END}) in its text"
            )
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    headers = []
    at = whole.find(ASSISTANT_HEADER)
    while at >= 0:
        headers.append(at)
        at = whole.find(ASSISTANT_HEADER, at + 1)
    if len(headers) != len(turns):
        raise DataError(
            f"{where}: the chat template rendered {len(headers)} assistant turn(s) "
            f"for {len(turns)} assistant message(s); their tokens cannot be "
            "labelled exactly"
        )
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    last_query = users[-1] if users else -1
    spans = []
    for i, header in zip(turns, headers, strict=True):
        start = header + len(ASSISTANT_HEADER)
        end = whole.find(TURN_END, start)
        if end < 0:
            raise DataError(
                f"{where}: the chat template does not close messages[{i}] "
                f"(assistant) with {TURN_END}"
            )
        end += len(TURN_END)
        tail = shape.generation_tail
        if tail and whole.startswith(tail, start):
            start += len(tail)
        _check_inside(whole[start:end], messages[i], i, where)
        if train_on == "assistant" or i > last_query:
            spans.append((start, end))
    return spans


def _check_inside(span: str, message: dict, i: int, where: str) -> None:
    """The message's answer and its tool calls' names lie in ``span`` (its reasoning is the
    template's to keep or drop)."""
    wanted = [_answer(message)]
    wanted += [
        call.get("function", call).get("name", "") for call in message.get("tool_calls") or ()
    ]
    missing = [text for text in wanted if text and text not in span]
    if missing:
        raise DataError(
            f"{where}: messages[{i}] (assistant): {missing[0][:60]!r} is not inside "
            "its rendered turn, so the turn's tokens cannot be labelled exactly"
        )
