"""Conversation rows → documents, through the model's own processor.

A row is ``{"messages": [{"role", "content"}, ...]}``; ``content`` is a string or a list of parts
``{"type": "text", "text"}``, ``{"type": "image", "path"}``, ``{"type": "video", "path"}`` where a
video ``path`` is a video file (decoded with PyAV) or a list of frame image paths (optionally
with ``"fps"``, default ``data.frames_fps``). Relative paths are relative to the dataset file.

:class:`ConversationEncoder` renders the row with the processor's chat template and runs the
processor unchanged (image resizing within its ``min_pixels`` / ``max_pixels``, video frame
sampling at its ``fps`` up to ``max_frames`` — ``data.video_fps`` / ``data.max_frames`` override —
and Qwen3.5's per-frame timestamps). Only the frames the processor samples are decoded.

Loss masking (``data.train_on``): ``assistant`` labels exactly the tokens of assistant turns,
``all`` every text token. The assistant turns are found with the template itself: turn ``i``'s
text is what ``render(messages[:i+1])`` adds to ``render(messages[:i], add_generation_prompt)``,
and both must be prefixes of the whole rendering (checked: a template that rewrites earlier turns
is refused, not silently mislabelled). The rendering is cut at those boundaries and the pieces go
through the processor as one list, so media expand in order across the pieces and every token
knows its piece. Media placeholders never carry labels.

Every problem — an unreadable row, an unknown part type, a missing or unreadable media file, a
row without a trainable turn — raises :class:`DataError` naming the file and row.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from qwen35_trainer.data.batch import IGNORE_INDEX, DataError, Sample
from qwen35_trainer.data.media import frame_list_video, open_image, video_file

__all__ = ["ConversationEncoder", "DataError", "TokenIds", "check_messages"]

ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "image", "video")


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """The model's special token ids (the recipe's ``model.*_token_id``)."""

    image: int
    video: int
    vision_start: int
    vision_end: int


def check_messages(row: Any, where: str) -> list[dict]:
    """The row's ``messages``, checked: a list of ``{role, content}`` with known roles and parts."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: expected a non-empty list under 'messages', got {messages!r:.80}"
        )
    for t, turn in enumerate(messages):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise DataError(f"{where}: messages[{t}] must have a role in {ROLES}, got {turn!r:.80}")
        content = turn.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise DataError(f"{where}: messages[{t}].content must be a string or a list of parts")
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES:
                raise DataError(f"{where}: messages[{t}].content[{p}] has unknown type {kind!r}; "
                                f"expected one of {PART_TYPES}")  # fmt: skip
            key = "text" if kind == "text" else "path"
            value = part.get(key)
            ok = isinstance(value, str) or (kind == "video" and isinstance(value, list)
                                            and value and all(isinstance(v, str) for v in value))  # fmt: skip
            if not ok:
                raise DataError(f"{where}: messages[{t}].content[{p}] ({kind}) needs '{key}' "
                                f"({'a path or a list of frame paths' if kind == 'video' else 'a string'}), "
                                f"got {value!r:.80}")  # fmt: skip
    return messages


class ConversationEncoder:
    """Encodes rows with the processor in ``processor_dir`` (loaded lazily, so the encoder can be
    sent to data-loader workers). ``config``: the model config (for M-RoPE positions)."""

    def __init__(self, processor_dir: str, ids: TokenIds, config: Any, *, train_on: str = "assistant",
                 video_fps: float | None = None, max_frames: int | None = None,
                 frames_fps: float = 2.0) -> None:  # fmt: skip
        self.processor_dir = processor_dir
        self.ids = ids
        self.config = config
        self.train_on = train_on
        self.video_fps = video_fps
        self.max_frames = max_frames
        self.frames_fps = frames_fps
        self._processor = None

    @property
    def processor(self):
        if self._processor is None:
            self._processor = load_processor(self.processor_dir, self.ids, self.config)
            if self.max_frames is not None:
                self._processor.video_processor.max_frames = self.max_frames
        return self._processor

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_processor": None}

    def __call__(self, row: Any, where: str, base: Path) -> Sample:
        messages = check_messages(row, where)
        processor = self.processor
        pieces, trained = self._pieces(messages, where)
        images, videos, metadata = self._media(messages, where, base)
        kwargs: dict[str, Any] = {}
        if videos:
            kwargs = {"videos": videos, "video_metadata": metadata, "do_sample_frames": False}
        try:
            out = processor(text=pieces, images=images or None, padding=False, return_tensors=None,
                            **kwargs)  # fmt: skip
        except (ValueError, IndexError) as error:
            raise DataError(f"{where}: the processor refused the row: {error}") from error
        ids, labels, mm = [], [], []
        for piece_ids, piece_mm, train in zip(out["input_ids"], out["mm_token_type_ids"], trained,
                                              strict=True):  # fmt: skip
            piece_ids, piece_mm = torch.tensor(piece_ids), torch.tensor(piece_mm)
            take = (
                piece_mm == 0
                if (train or self.train_on == "all")
                else torch.zeros_like(piece_mm, dtype=torch.bool)
            )
            ids.append(piece_ids)
            mm.append(piece_mm)
            labels.append(piece_ids.masked_fill(~take, IGNORE_INDEX))
        sample = Sample(input_ids=torch.cat(ids).long(), labels=torch.cat(labels).long(),
                        mm_token_type_ids=torch.cat(mm).long(), source=where)  # fmt: skip
        if (sample.labels[1:] == IGNORE_INDEX).all():
            raise DataError(f"{where}: no trainable token (data.train_on={self.train_on!r}: the "
                            "row needs an assistant turn with content)")  # fmt: skip
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            if out.get(key) is not None:
                setattr(sample, key, torch.as_tensor(out[key]))
        from cp_varlen_attn import mrope_positions

        sample.position_ids = mrope_positions(self.config, sample.input_ids,
                                              sample.mm_token_type_ids, sample.image_grid_thw,
                                              sample.video_grid_thw)  # fmt: skip
        return sample

    def _pieces(self, messages: list[dict], where: str) -> tuple[list[str], list[bool]]:
        """The rendering cut at every assistant turn's start and end; ``trained[k]``: piece ``k``
        is an assistant turn."""
        render = self.processor.apply_chat_template
        whole = render(messages, tokenize=False)
        cuts: list[tuple[int, int]] = []
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            prompt = render(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            done = render(messages[: i + 1], tokenize=False)
            if not (done.startswith(prompt) and whole.startswith(done)):
                raise DataError(f"{where}: the chat template renders messages[{i}] (assistant) "
                                "differently once later turns follow; its tokens cannot be "
                                "labelled exactly")  # fmt: skip
            cuts.append((len(prompt), len(done)))
        pieces, trained, at = [], [], 0
        for start, end in cuts:
            if start > at:
                pieces.append(whole[at:start])
                trained.append(False)
            pieces.append(whole[start:end])
            trained.append(True)
            at = end
        if at < len(whole) or not pieces:
            pieces.append(whole[at:])
            trained.append(False)
        return pieces, trained

    def _media(self, messages: list[dict], where: str, base: Path):
        images, videos, metadata = [], [], []
        for turn in messages:
            if isinstance(turn["content"], str):
                continue
            for part in turn["content"]:
                if part["type"] == "image":
                    images.append(open_image(base, part["path"], where))
                elif part["type"] == "video":
                    frames, meta = self._video(base, part, where)
                    videos.append(frames)
                    metadata.append(meta)
        return images, videos, metadata

    def _video(self, base: Path, part: dict, where: str):
        sample = self.processor.video_processor.sample_frames
        if isinstance(part["path"], list):
            fps = float(part.get("fps", self.frames_fps))
            return frame_list_video(base, part["path"], fps, sample, self.video_fps, where)
        return video_file(base, part["path"], sample, self.video_fps, where)


def load_processor(folder: str, ids: TokenIds, config: Any):
    """``AutoProcessor.from_pretrained(folder)`` offline, checked against the model: the
    processor's image / video / vision-marker token ids must be the recipe's, its vocabulary
    must fit the model's."""
    from transformers import AutoProcessor

    if not Path(folder).is_dir():
        raise DataError(f"data.processor: {folder} is not a directory (a processor saved by "
                        "transformers, e.g. a Qwen3.5 checkpoint directory)")  # fmt: skip
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    tokenizer = processor.tokenizer
    got = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
        ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"))}  # fmt: skip
    bad = [f"{name} token id {got[name]} (model.{name}_token_id is {getattr(ids, name)})"
           for name in got if got[name] != getattr(ids, name)]  # fmt: skip
    vocab = getattr(getattr(config, "text_config", config), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        bad.append(f"{len(tokenizer)} tokens, more than model.text.vocab_size={vocab}")
    if bad:
        raise DataError(f"data.processor {folder} does not match the model: " + "; ".join(bad))
    return processor
