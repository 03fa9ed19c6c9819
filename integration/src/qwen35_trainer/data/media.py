"""Reading media for the processor: images with Pillow, videos as lists of frames or video
files decoded with PyAV. Only the frames the processor's sampler picks are kept; the metadata
handed on (``fps``, ``frames_indices``) is what Qwen3.5's processor turns into frame timestamps.

A source (:mod:`qwen35_trainer.data.formats`) is a file path relative to ``base`` (the dataset
file's folder), a ``data:`` URL (``data:image/png;base64,...``: its bytes, never a path built
from it), ``{"bytes", "path"}`` as ``datasets``' ``Image`` / ``Video`` columns store them (the
bytes when present, else the path), raw bytes, or for an image a PIL image. Every failure
raises :class:`~qwen35_trainer.data.batch.DataError` naming the row and the media (a long
source cut short).
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qwen35_trainer.data.batch import DataError

__all__ = ["data_url_bytes", "frame_list_video", "open_image", "open_video", "video_file"]


def _error(where: str, path: Any, what: str) -> DataError:
    shown = str(path)
    shown = shown if len(shown) <= 120 else f"{shown[:100]}... ({len(shown)} characters)"
    return DataError(f"{where}: {what} {shown}")


def data_url_bytes(url: str, where: str) -> bytes:
    """The payload of a ``data:[<type>][;base64],<data>`` URL; ``DataError`` naming ``where``
    when it is not one."""
    head, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma:
        raise _error(where, url, "not a data URL (data:[<type>][;base64],<data>):")
    if not head.endswith(";base64"):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise _error(
            where, head + ",...", f"a data URL whose base64 is invalid ({error}):"
        ) from error


def _file_or_bytes(base: Path, source: Any, where: str) -> tuple[Any, str]:
    """``(a file path or a binary stream, its name for messages)`` of a source."""
    if isinstance(source, dict):
        data, path = source.get("bytes"), source.get("path")
        if data is None and path is None:
            raise _error(where, source, "a media source with neither 'bytes' nor 'path':")
        source = data if data is not None else path
    if isinstance(source, str) and source.startswith("data:"):
        source = data_url_bytes(source, where)
    if isinstance(source, (bytes, bytearray)):
        return io.BytesIO(source), f"(embedded, {len(source)} bytes)"
    if not isinstance(source, (str, Path)):
        raise _error(
            where,
            type(source).__name__,
            "unknown media source: expected a path, a data URL, bytes or an image, got",
        )
    full = base / source
    try:
        found = full.is_file()
    except OSError as error:  # e.g. a name longer than the file system takes
        raise _error(where, source, f"not a usable file path ({error.strerror}):") from error
    if not found:
        raise _error(where, full, "missing media file")
    return full, str(full)


def open_image(base: Path, source: Any, where: str):
    """The RGB image of ``source`` (a path relative to ``base``, ``{"bytes", "path"}``, bytes or
    a PIL image)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    opened, name = _file_or_bytes(base, source, where)
    try:
        with Image.open(opened) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as error:
        raise _error(where, name, f"unreadable image ({error}):") from error


def open_video(
    base: Path, source: Any, fps: float, sample: Callable, video_fps: float | None, where: str
):
    """``(frames [T, H, W, 3] uint8, metadata)`` of a video: a list of frames (paths or images,
    at ``fps``) or a video file (a path, ``{"bytes", "path"}`` or bytes)."""
    if isinstance(source, list):
        if not source:
            raise _error(where, "[]", "a video with no frames:")
        return frame_list_video(base, source, fps, sample, video_fps, where)
    return video_file(base, source, sample, video_fps, where)


def _metadata(total: int, fps: float, sample: Callable, video_fps: float | None):
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=total, fps=fps)
    indices = [int(i) for i in sample(meta, fps=video_fps)]
    meta.frames_indices = indices
    return meta


def frame_list_video(
    base: Path, frames: list, fps: float, sample: Callable, video_fps: float | None, where: str
):
    """``(frames [T, H, W, 3] uint8, metadata)`` of a video given as frame images at ``fps``
    (each an image source, :func:`open_image`)."""
    meta = _metadata(len(frames), fps, sample, video_fps)
    kept = [np.asarray(open_image(base, frames[i], where)) for i in meta.frames_indices]
    if len({f.shape for f in kept}) > 1:
        first = frames[0] if isinstance(frames[0], str) else "(frame 0)"
        raise _error(where, first, "frames of different sizes in the video starting at")
    return np.stack(kept), meta


def video_file(base: Path, source: Any, sample: Callable, video_fps: float | None, where: str):
    """``(frames [T, H, W, 3] uint8, metadata)`` of the frames the sampler picks from a video
    file (a path relative to ``base``, ``{"bytes", "path"}`` or bytes), decoded in one pass with
    PyAV keeping only those (all of them where the container does not say how many frames it
    has)."""
    full, name = _file_or_bytes(base, source, where)
    try:
        import av
    except ImportError as error:
        raise _error(where, name, "decoding a video file needs PyAV (pip install av):") from error
    try:
        with av.open(full if isinstance(full, io.BytesIO) else str(full)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0) or 24.0
            total = stream.frames  # 0 where the container does not say
            meta = _metadata(total, fps, sample, video_fps) if total else None
            keep = set(meta.frames_indices) if meta else None
            decoded = {
                k: frame.to_ndarray(format="rgb24")
                for k, frame in enumerate(container.decode(stream))
                if keep is None or k in keep
            }
    except (av.FFmpegError, IndexError) as error:
        raise _error(where, name, f"unreadable video ({error}):") from error
    if not decoded:
        raise _error(where, name, "no frames in video")
    if meta is None:
        meta = _metadata(len(decoded), fps, sample, video_fps)
    missing = [i for i in meta.frames_indices if i not in decoded]
    if missing:
        raise _error(where, name, f"frames {missing[:4]} listed by the container are not in")
    return np.stack([decoded[i] for i in meta.frames_indices]), meta
