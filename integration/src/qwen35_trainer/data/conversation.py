"""Conversation rows → documents, through the model's own processor.

A row is any format :mod:`qwen35_trainer.data.formats` reads — messages (the ecosystem's chat
format), TRL prompt / completion, ShareGPT, Alpaca; media as parts with their own source or as
placeholders (``{"type": "image"}``, ``<image>``) taking the row's ``images`` / ``videos`` in
order — normalised into ONE :class:`~qwen35_trainer.data.formats.Conversation` first, so every
format encodes exactly as the same conversation written as messages. Relative media paths are
relative to the dataset file; media are read by :mod:`qwen35_trainer.data.media`.

:class:`ConversationEncoder` renders the row ONCE with the processor's chat template
(``data.chat_template_kwargs`` reach the template, e.g. ``enable_thinking: false``) and runs the
processor unchanged (image resizing within its ``min_pixels`` / ``max_pixels``, video frame
sampling at its ``fps`` up to ``max_frames`` — ``data.video_fps`` / ``data.max_frames`` override —
and Qwen3.5's per-frame timestamps). Only the frames the processor samples are decoded.

Loss masking (``data.train_on``): ``assistant`` labels what the model generates in every
assistant turn of the full rendering (:mod:`qwen35_trainer.data.chat_turns`: the turn after its
header and after the tokens the generation prompt supplies, through its closing ``<|im_end|>``;
with Qwen3.5's template earlier turns without their reasoning, the latest with it),
``last_assistant`` only the turns after the last user query, ``all`` every text token. The
rendering is cut at the labelled spans and the pieces go through the processor as one list, so
media expand in order and every token knows its piece; a labelled turn is tokenized apart from
the prompt before it, as it is at inference. Media placeholders never carry labels.

Every problem — an unreadable row, an unknown part type or role, a missing or unreadable media
file, a row without a trainable turn, a turn the template renders where it cannot be located
exactly — raises :class:`DataError` naming the file and row.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from qwen35_trainer.data.batch import IGNORE_INDEX, DataError, Sample
from qwen35_trainer.data.chat_turns import assistant_spans, template_shape
from qwen35_trainer.data.formats import Conversation, normalise
from qwen35_trainer.data.media import open_image, open_video

__all__ = ["ConversationEncoder", "DataError", "TokenIds"]


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """The model's special token ids (the recipe's ``model.*_token_id``)."""

    image: int
    video: int
    vision_start: int
    vision_end: int


class ConversationEncoder:
    """Encodes rows with the processor in ``processor_dir`` (loaded lazily, so the encoder can be
    sent to data-loader workers). ``config``: the model config (for M-RoPE positions)."""

    def __init__(
        self,
        processor_dir: str,
        ids: TokenIds,
        config: Any,
        *,
        train_on: str = "assistant",
        video_fps: float | None = None,
        max_frames: int | None = None,
        frames_fps: float = 2.0,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.processor_dir = processor_dir
        self.ids = ids
        self.config = config
        self.train_on = train_on
        self.video_fps = video_fps
        self.max_frames = max_frames
        self.frames_fps = frames_fps
        self.template_kwargs = dict(chat_template_kwargs or {})
        self._processor = self._shape = None

    @classmethod
    def from_recipe(cls, data: Any, model: Any, config: Any):
        """The encoder a recipe's ``data`` and ``model`` sections describe (the processor:
        ``data.processor``, a local folder once the recipe is built)."""
        ids = TokenIds(
            model.image_token_id,
            model.video_token_id,
            model.vision_start_token_id,
            model.vision_end_token_id,
        )
        return cls(
            data.processor,
            ids,
            config,
            train_on=data.train_on,
            video_fps=data.video_fps,
            max_frames=data.max_frames,
            frames_fps=data.frames_fps,
            chat_template_kwargs=data.chat_template_kwargs,
        )

    @property
    def processor(self):
        if self._processor is None:
            self._processor = load_processor(self.processor_dir, self.ids, self.config)
            if self.max_frames is not None:
                self._processor.video_processor.max_frames = self.max_frames
        return self._processor

    def check_template(self) -> None:
        """``ValueError`` (the same on every rank) when the processor's chat template cannot be
        labelled exactly (:func:`qwen35_trainer.data.chat_turns.template_shape`); with
        ``train_on: all`` such a template is used unlabelled, uncut."""
        if self._shape is not None:
            return
        try:
            self._shape = template_shape(
                self.processor.apply_chat_template,
                self.template_kwargs,
                f"data.processor {self.processor_dir}",
            )
        except ValueError:
            if self.train_on != "all":
                raise
            self._shape = False

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_processor": None}

    def __call__(self, row: Any, where: str, base: Path) -> Sample:
        conversation = normalise(row, where)
        processor = self.processor
        pieces, trained = self._pieces(conversation.messages, conversation.tools, where)
        images, videos, metadata = self._media(conversation, where, base)
        kwargs: dict[str, Any] = {}
        if videos:
            kwargs = {"videos": videos, "video_metadata": metadata, "do_sample_frames": False}
        try:
            out = processor(
                text=pieces, images=images or None, padding=False, return_tensors=None, **kwargs
            )
        except (ValueError, IndexError) as error:
            raise DataError(f"{where}: the processor refused the row: {error}") from error
        ids, labels, mm = [], [], []
        for piece_ids, piece_mm, train in zip(
            out["input_ids"], out["mm_token_type_ids"], trained, strict=True
        ):
            piece_ids, piece_mm = torch.tensor(piece_ids), torch.tensor(piece_mm)
            take = piece_mm == 0 if train else torch.zeros_like(piece_mm, dtype=torch.bool)
            ids.append(piece_ids)
            mm.append(piece_mm)
            labels.append(piece_ids.masked_fill(~take, IGNORE_INDEX))
        sample = Sample(
            input_ids=torch.cat(ids).long(),
            labels=torch.cat(labels).long(),
            mm_token_type_ids=torch.cat(mm).long(),
            source=where,
        )
        if (sample.labels[1:] == IGNORE_INDEX).all():
            raise DataError(
                f"{where}: no trainable token (data.train_on={self.train_on!r}: the "
                "row needs an assistant turn with content)"
            )
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            if out.get(key) is not None:
                setattr(sample, key, torch.as_tensor(out[key]))
        from cp_varlen_attn import mrope_positions

        sample.position_ids = mrope_positions(
            self.config,
            sample.input_ids,
            sample.mm_token_type_ids,
            sample.image_grid_thw,
            sample.video_grid_thw,
        )
        return sample

    def _pieces(self, messages: list[dict], tools: Any, where: str) -> tuple[list[str], list[bool]]:
        """The full rendering cut at every labelled span's start and end; ``trained[k]``: piece
        ``k`` is a labelled span."""
        kwargs = {**self.template_kwargs, **({"tools": tools} if tools else {})}
        try:
            whole = self.processor.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as error:  # the template's own raise_exception, jinja's errors
            raise DataError(f"{where}: the chat template refused the row: {error}") from error
        self.check_template()
        if self._shape is False:  # train_on: all, a template whose turns cannot be located
            return [whole], [True]
        every = self.train_on == "all"  # cut at the same turns, so the ids do not depend on it
        spans = assistant_spans(
            whole, messages, self._shape, "assistant" if every else self.train_on, where
        )
        pieces, trained, at = [], [], 0
        for start, end in spans:
            if start > at:
                pieces.append(whole[at:start])
                trained.append(every)
            pieces.append(whole[start:end])
            trained.append(True)
            at = end
        if at < len(whole) or not pieces:
            pieces.append(whole[at:])
            trained.append(every)
        return pieces, trained

    def _media(self, conversation: Conversation, where: str, base: Path):
        images = [open_image(base, source, where) for source in conversation.images]
        videos, metadata = [], []
        sample = self.processor.video_processor.sample_frames
        for video in conversation.videos:
            fps = self.frames_fps if video.fps is None else video.fps
            frames, meta = open_video(base, video.source, fps, sample, self.video_fps, where)
            videos.append(frames)
            metadata.append(meta)
        return images, videos, metadata


def load_processor(folder: str, ids: TokenIds, config: Any):
    """``AutoProcessor.from_pretrained(folder)`` offline, checked against the model: the
    processor's image / video / vision-marker token ids must be the recipe's, its vocabulary
    must fit the model's."""
    from transformers import AutoProcessor

    if not Path(folder).is_dir():
        raise DataError(
            f"data.processor: {folder} is not a directory (a processor saved by "
            "transformers, e.g. a Qwen3.5 checkpoint directory)"
        )
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    tokenizer = processor.tokenizer
    got = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image", "<|image_pad|>"),
            ("video", "<|video_pad|>"),
            ("vision_start", "<|vision_start|>"),
            ("vision_end", "<|vision_end|>"),
        )
    }
    bad = [
        f"{name} token id {got[name]} (model.{name}_token_id is {getattr(ids, name)})"
        for name in got
        if got[name] != getattr(ids, name)
    ]
    vocab = getattr(getattr(config, "text_config", config), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        bad.append(f"{len(tokenizer)} tokens, more than model.text.vocab_size={vocab}")
    if bad:
        raise DataError(f"data.processor {folder} does not match the model: " + "; ".join(bad))
    return processor
