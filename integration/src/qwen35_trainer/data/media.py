"""Reading media for the processor: images with Pillow, videos as frame-image lists or video
files decoded with PyAV. Only the frames the processor's sampler picks are kept; the metadata
handed on (``fps``, ``frames_indices``) is what Qwen3.5's processor turns into frame timestamps.
Every failure raises :class:`~qwen35_trainer.data.batch.DataError` naming the row and the media
file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from qwen35_trainer.data.batch import DataError

__all__ = ["frame_list_video", "open_image", "video_file"]


def _error(where: str, path: Path, what: str) -> DataError:
    return DataError(f"{where}: {what} {path}")


def open_image(base: Path, path: str, where: str):
    """The RGB image at ``base / path``."""
    from PIL import Image, UnidentifiedImageError

    full = base / path
    if not full.is_file():
        raise _error(where, full, "missing media file")
    try:
        with Image.open(full) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError) as error:
        raise _error(where, full, f"unreadable image ({error}):") from error


def _metadata(total: int, fps: float, sample: Callable, video_fps: float | None):
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=total, fps=fps)
    indices = [int(i) for i in sample(meta, fps=video_fps)]
    meta.frames_indices = indices
    return meta


def frame_list_video(
    base: Path, paths: list[str], fps: float, sample: Callable, video_fps: float | None, where: str
):
    """``(frames [T, H, W, 3] uint8, metadata)`` of a video given as frame images at ``fps``."""
    meta = _metadata(len(paths), fps, sample, video_fps)
    frames = [np.asarray(open_image(base, paths[i], where)) for i in meta.frames_indices]
    if len({f.shape for f in frames}) > 1:
        raise _error(where, base / paths[0], "frames of different sizes in the video starting at")
    return np.stack(frames), meta


def video_file(base: Path, path: str, sample: Callable, video_fps: float | None, where: str):
    """``(frames [T, H, W, 3] uint8, metadata)`` of the frames the sampler picks from a video
    file, decoded in one pass with PyAV keeping only those (all of them where the container
    does not say how many frames it has)."""
    full = base / path
    if not full.is_file():
        raise _error(where, full, "missing media file")
    try:
        import av
    except ImportError as error:
        raise _error(where, full, "decoding a video file needs PyAV (pip install av):") from error
    try:
        with av.open(str(full)) as container:
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
        raise _error(where, full, f"unreadable video ({error}):") from error
    if not decoded:
        raise _error(where, full, "no frames in video")
    if meta is None:
        meta = _metadata(len(decoded), fps, sample, video_fps)
    missing = [i for i in meta.frames_indices if i not in decoded]
    if missing:
        raise _error(where, full, f"frames {missing[:4]} listed by the container are not in")
    return np.stack([decoded[i] for i in meta.frames_indices]), meta
