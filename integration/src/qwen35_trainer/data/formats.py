"""Every row format the trainer reads, normalised into ONE form: a :class:`Conversation`.

Accepted rows (keys whose value is ``null`` count as absent, as ``datasets`` fills them):

- **messages** — ``{"messages": [{"role", "content"}, ...], "tools"?}``, the ecosystem's chat
  format: roles ``system`` / ``user`` / ``assistant`` / ``tool``; ``content`` a string or a
  list of parts ``{"type": "text", "text"}``, ``{"type": "image", ...}``,
  ``{"type": "video", ...}``; an assistant turn may carry ``reasoning_content`` and
  ``tool_calls`` (``[{"function": {"name", "arguments"}}]``, its content then optional).
- **prompt / completion** (TRL) — ``{"prompt": [turns], "completion": [turns]}`` (the
  conversation is the one list after the other), or two strings (a user and an assistant turn).
- **ShareGPT** — ``{"conversations": [{"from", "value"}, ...], "system"?, "tools"?}`` with
  ``from`` in ``human`` / ``user``, ``gpt`` / ``assistant``, ``system``, ``observation`` /
  ``tool``, and ``function_call`` (its value a JSON ``{"name", "arguments"}`` or a list of
  them: an assistant turn of tool calls); ``tools`` may be a JSON string (LLaMA-Factory).
- **Alpaca** (LLaMA-Factory) — ``{"instruction", "input"?, "output", "system"?,
  "history"?: [[query, answer], ...]}``: the history's turns, then ``instruction`` (and
  ``input`` after a newline) as the user turn and ``output`` as the answer.

Media. A part states its source under ``path`` or transformers' key (``image`` / ``video``):
a file path (relative to the dataset file), an image object or ``{"bytes", "path"}`` (what
``datasets``' ``Image`` / ``Video`` columns hold); a video is also a list of frames (paths or
images; ``fps`` default ``data.frames_fps``). A part with no source — ``{"type": "image"}``
(TRL, Hub datasets) — and each ``<image>`` / ``<video>`` marker in a text (LLaMA-Factory) is a
placeholder: placeholders take the row's ``images`` / ``videos`` list in order of appearance
(a placeholder's ``index``, where given, must be its place in that order). A row whose
placeholders disagree with its list is a bad row naming both counts — a marker is never trained
as text. So ``<image>`` / ``<video>`` can only appear in a text as markers. A source may also
be a ``data:`` URL (under ``path``, ``image`` / ``video``, ``url`` or OpenAI's ``image_url`` /
``video_url`` parts, ``{"url": ...}`` or a string) or base64 under ``base64``: the media's
bytes. Remote URLs are refused (nothing is downloaded at run time).

:func:`normalise` returns the conversation with template-ready messages (media parts reduced
to ``{"type": "image"}`` / ``{"type": "video"}``, texts split at the markers, ``null`` keys
dropped) and the media sources in the order the template renders them — the order the
processor expands them in. Every problem is a :class:`~qwen35_trainer.data.batch.DataError`
naming the row.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
from typing import Any

from qwen35_trainer.data.batch import DataError

__all__ = ["Conversation", "Video", "normalise"]

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "image", "video", "image_url", "video_url")
MARKERS = {"<image>": "image", "<video>": "video"}
_MARKER = re.compile("(<image>|<video>)")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "observation": "tool",
    "tool": "tool",
    "function_call": "assistant",
}


@dataclasses.dataclass(frozen=True)
class Video:
    """A video's source (a file path, ``{"bytes", "path"}``, or a list of frames) and, for a
    list of frames, their rate (``None``: ``data.frames_fps``)."""

    source: Any
    fps: float | None = None


@dataclasses.dataclass
class Conversation:
    """One row in the one form: ``messages`` as the chat template takes them, ``tools`` (or
    ``None``), and the sources of the images and videos in order of appearance."""

    messages: list[dict]
    tools: list | None
    images: list[Any]
    videos: list[Video]


def normalise(row: Any, where: str) -> Conversation:
    """``row`` (any accepted format, module docstring) as a :class:`Conversation`."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a row object, got {type(row).__name__}")
    forms = [k for k in ("messages", "conversations", "prompt", "instruction") if row.get(k)]
    if len(forms) != 1:
        raise DataError(
            f"{where}: expected a conversation under exactly one of 'messages' (a list of "
            "{role, content}), 'conversations' (ShareGPT {from, value}), 'prompt' + "
            "'completion' (TRL) or 'instruction' / 'output' (Alpaca); the row has "
            + (f"{forms}" if forms else f"keys {sorted(row)}")
        )
    form = forms[0]
    if form == "messages":
        turns = _listed(row, "messages", where)
    elif form == "conversations":
        turns = _sharegpt(row, where)
    elif form == "prompt":
        turns = _prompt_completion(row, where)
    else:
        turns = _alpaca(row, where)
    media = _Media(
        _listed(row, "images", where, empty=True), _listed(row, "videos", where, empty=True)
    )
    label = "messages[{}]" if form == "messages" else "turn {} (as messages)"
    messages = [_turn(turn, f"{where}: {label.format(t)}", media) for t, turn in enumerate(turns)]
    media.check_counts(where)
    return Conversation(messages, _tools(row.get("tools"), where), media.images, media.videos)


def _listed(row: dict, key: str, where: str, *, empty: bool = False) -> list:
    value = row.get(key)
    if value is None and empty:
        return []
    if not isinstance(value, list) or not (value or empty):
        raise DataError(f"{where}: expected a non-empty list under {key!r}, got {value!r:.80}")
    return value


def _tools(tools: Any, where: str) -> list | None:
    if isinstance(tools, str):  # LLaMA-Factory keeps the schemas as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: 'tools' is a string but not JSON ({error.msg})") from error
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of function schemas, got {tools!r:.80}")
    return tools or None


def _sharegpt(row: dict, where: str) -> list[dict]:
    turns = []
    if isinstance(row.get("system"), str) and row["system"]:
        turns.append({"role": "system", "content": row["system"]})
    for t, turn in enumerate(_listed(row, "conversations", where)):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: conversations[{t}] must be an object, got {turn!r:.80}")
        speaker = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        if speaker not in SHAREGPT_ROLES:
            raise DataError(
                f"{where}: conversations[{t}] 'from' must be one of {sorted(SHAREGPT_ROLES)}, "
                f"got {speaker!r:.40}"
            )
        if speaker == "function_call":
            turns.append(_function_call(value, f"{where}: conversations[{t}]"))
        else:
            turns.append({"role": SHAREGPT_ROLES[speaker], "content": value})
    return turns


def _function_call(value: Any, where: str) -> dict:
    """An assistant turn of tool calls from a ShareGPT ``function_call`` value."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as error:
        raise DataError(f"{where} (function_call): value is not JSON ({error.msg})") from error
    calls = calls if isinstance(calls, list) else [calls]
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": call} for call in calls],
    }


def _prompt_completion(row: dict, where: str) -> list[dict]:
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    if isinstance(prompt, list) and isinstance(completion, list) and completion:
        return [*prompt, *completion]
    raise DataError(
        f"{where}: 'prompt' and 'completion' must both be lists of turns or both strings, got "
        f"{type(prompt).__name__} and {type(completion).__name__}"
    )


def _alpaca(row: dict, where: str) -> list[dict]:
    texts = {k: row.get(k) or "" for k in ("instruction", "input", "output", "system")}
    bad = [k for k, v in texts.items() if not isinstance(v, str)]
    if bad or not texts["output"]:
        raise DataError(
            f"{where}: an Alpaca row needs 'instruction' and 'output' strings ('input', "
            f"'system' optional); got { ({k: texts[k] for k in bad} or 'no output')!r:.80}"
        )
    turns = [{"role": "system", "content": texts["system"]}] if texts["system"] else []
    for h, pair in enumerate(row.get("history") or ()):
        if not (
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)
        ):
            raise DataError(f"{where}: history[{h}] must be [query, answer], got {pair!r:.80}")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    query = "\n".join(text for text in (texts["instruction"], texts["input"]) if text)
    return [
        *turns,
        {"role": "user", "content": query},
        {"role": "assistant", "content": texts["output"]},
    ]


class _Media:
    """The media of one row in order of appearance: each part's own source, or the next entry
    of the row's ``images`` / ``videos`` list for a placeholder."""

    def __init__(self, images: list, videos: list) -> None:
        self.listed = {"image": images, "video": videos}
        self.taken = {"image": 0, "video": 0}
        self.markers = {"image": 0, "video": 0}
        self.images: list[Any] = []
        self.videos: list[Video] = []

    def add(self, kind: str, source: Any, fps: Any, *, marker: bool = False) -> dict:
        if source is None:  # a placeholder: the list's next entry
            self.markers[kind] += marker
            at = self.taken[kind]
            self.taken[kind] += 1
            listed = self.listed[kind]
            source = listed[at] if at < len(listed) else None
        if kind == "image":
            self.images.append(source)
        else:
            self.videos.append(Video(source, None if fps is None else float(fps)))
        return {"type": kind}

    def check_counts(self, where: str) -> None:
        for kind, listed in self.listed.items():
            taken = self.taken[kind]
            if taken != len(listed):
                markers = self.markers[kind]
                raise DataError(
                    f"{where}: {taken} {kind} placeholder(s) ({markers} '<{kind}>' marker(s) "
                    f"in the text, {taken - markers} {{'type': '{kind}'}} part(s) without a "
                    f"source) for {len(listed)} {kind}(s) under '{kind}s'"
                )


def _turn(turn: Any, where: str, media: _Media) -> dict:
    if not isinstance(turn, dict) or turn.get("role") not in ROLES:
        raise DataError(f"{where} must have a role in {ROLES}, got {turn!r:.80}")
    out = {k: v for k, v in turn.items() if v is not None and k != "content"}
    _check_extras(out, where)
    content = turn.get("content")
    if content is None and turn.get("tool_calls"):
        out["content"] = ""
    elif isinstance(content, str):
        out["content"] = _split_markers(content, media) if _MARKER.search(content) else content
    elif isinstance(content, list):
        out["content"] = [
            new
            for p, part in enumerate(content)
            for new in _part(part, f"{where}.content[{p}]", media)
        ]
    else:
        raise DataError(f"{where}.content must be a string or a list of parts, got {content!r:.80}")
    return out


def _split_markers(text: str, media: _Media) -> list[dict]:
    parts = []
    for piece in _MARKER.split(text):
        if piece in MARKERS:
            parts.append(media.add(MARKERS[piece], None, None, marker=True))
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _part(part: Any, where: str, media: _Media) -> list[dict]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in PART_TYPES:
        raise DataError(f"{where} has unknown type {kind!r}; expected one of {PART_TYPES}")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise DataError(f"{where} (text) needs 'text' (a string), got {text!r:.80}")
        return (
            _split_markers(text, media)
            if _MARKER.search(text)
            else [{"type": "text", "text": text}]
        )
    kind = kind.removesuffix("_url")  # OpenAI's image_url / video_url parts
    sources = [part[k] for k in ("path", kind) if part.get(k) is not None]
    for key in ("url", f"{kind}_url"):
        if part.get(key) is not None:
            sources.append(_url(part[key], key, kind, where))
    if part.get("base64") is not None:
        sources.append(_base64(part["base64"], kind, where))
    if len(sources) > 1:
        keys = [
            k for k in ("path", kind, "url", f"{kind}_url", "base64") if part.get(k) is not None
        ]
        raise DataError(f"{where} ({kind}) has {len(sources)} sources, under {keys}")
    index = part.get("index")
    if not sources and index is not None and index != media.taken[kind]:
        raise DataError(
            f"{where} ({kind}) says index {index}, but it is {kind} placeholder "
            f"{media.taken[kind]} in order of appearance"
        )
    fps = part.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0):
        raise DataError(f"{where} ({kind}) 'fps' must be a number > 0, got {fps!r:.40}")
    return [media.add(kind, sources[0] if sources else None, fps)]


def _url(value: Any, key: str, kind: str, where: str) -> str:
    """A part's ``url`` / ``image_url`` (a string, or OpenAI's ``{"url": ...}``): a ``data:``
    URL is the media's bytes (decoded where the media is read); a remote URL is refused."""
    url = value.get("url") if isinstance(value, dict) else value
    if isinstance(url, str) and url.startswith("data:"):
        return url
    shown = url if isinstance(url, str) and len(url) <= 100 else f"{str(url)[:80]}..."
    raise DataError(
        f"{where} ({kind}) has a remote {key!r} ({shown}): nothing is downloaded at run time; "
        "download it and give its file under 'path', or embed it as a data: URL"
    )


def _base64(value: Any, kind: str, where: str) -> bytes:
    """A part's ``base64`` key: the media's bytes."""
    try:
        if not isinstance(value, str):
            raise ValueError(f"a string expected, got {type(value).__name__}")
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as error:
        raise DataError(f"{where} ({kind}) 'base64' is not base64 data: {error}") from error


def _check_extras(turn: dict, where: str) -> None:
    """An assistant turn's ``reasoning_content`` is a string and its ``tool_calls`` name their
    functions; other roles carry neither."""
    reasoning, calls = turn.get("reasoning_content"), turn.get("tool_calls")
    if turn["role"] != "assistant" and (reasoning is not None or calls):
        raise DataError(f"{where}: only assistant turns have reasoning_content / tool_calls")
    if reasoning is not None and not isinstance(reasoning, str):
        raise DataError(f"{where}.reasoning_content must be a string, got {reasoning!r:.80}")
    if calls is None:
        return
    for c, call in enumerate(calls if isinstance(calls, list) else [None]):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(
                f"{where}.tool_calls[{c}] must be {{'function': {{'name': str, "
                f"'arguments': ...}}}}, got {call!r:.80}"
            )
