"""Video inputs: frames sampled from a video file, or frames given as they are.

A video reaches a model as a short run of RGB frames (``VideoClip``). From a file (a ``data:
video/...`` URL) the frames are sampled as transformers' video processors sample them with
``fps``: about ``fps`` frames per second of video, at least ``min_frames`` and at most
``max_frames``, a multiple of the model's temporal patch (two frames for Qwen2-VL), evenly
spaced from the first frame. Decoding uses PyAV (the ``video`` extra); a server without it
refuses videos with one clear line. Frames given as objects (the offline API) are taken
as they are, up to ``max_frames``.

Sizes are checked before frames are decoded: the container's header gives the frame size
and count, so a short file that claims a huge video costs a header read.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from hydrad.errors import RequestError
from hydrad.images import data_url_bytes

VIDEO_MEDIA_TYPES = {"video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/x-msvideo",
                     "video/avi", "video/mpeg", "video/ogg"}
_FORMATS = "mp4, webm, mov, mkv, avi, mpeg or ogg"
# The frame rate transformers assumes for frames given without one (its ``VideoMetadata``).
DEFAULT_FRAMES_FPS = 24.0


@dataclass(frozen=True)
class EncodedVideo:
    """A video file whose header has been checked, decoded only when the request is processed."""

    data: bytes


@dataclass(frozen=True)
class VideoSampling:
    """How frames are drawn from a video file."""

    fps: float = 2.0  # frames per second of video
    min_frames: int = 4
    max_frames: int = 32
    temporal_patch: int = 2  # the count is a multiple of this


@dataclass
class VideoClip:
    """A video's frames as the model's processor takes them."""

    frames: np.ndarray  # [frames, height, width, 3] uint8 RGB
    fps: float  # frames per second of the frames as sampled (Qwen2.5-VL's time positions)
    source: bytes | None = None  # the file the frames came from, where there is one (the digest)
    sampling: VideoSampling | None = None  # how they were drawn from it

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of a frame, as PIL reports an image's."""
        return int(self.frames.shape[2]), int(self.frames.shape[1])


@dataclass(frozen=True)
class VideoHeader:
    """What a video file's container says before any frame is decoded."""

    num_frames: int
    fps: float | None
    width: int
    height: int


def sample_indices(num_frames: int, video_fps: float | None, sampling: VideoSampling) -> list[int]:
    """The frames to keep, as transformers' Qwen2-VL video processor's ``sample_frames`` picks them
    with ``fps`` (evenly spaced from frame 0). Without a frame rate, ``max_frames`` evenly spaced
    frames. A video shorter than one temporal patch keeps all its frames (the processor repeats
    the last one to fill the patch)."""
    t = sampling.temporal_patch
    max_frames = math.floor(min(sampling.max_frames, num_frames) / t) * t
    if video_fps:
        wanted = num_frames / video_fps * sampling.fps
        wanted = min(max(wanted, sampling.min_frames), max_frames, num_frames)
    else:
        wanted = max_frames
    wanted = math.floor(wanted / t) * t
    if wanted <= 0:
        return list(range(num_frames))
    import torch  # float32 steps, truncated, as the reference computes them

    return torch.arange(0, num_frames, num_frames / wanted).int().tolist()


def video_data_url_bytes(url: str, param: str) -> bytes:
    """The file a ``data:video/mp4;base64,...`` URL holds. RequestError for anything else."""
    return data_url_bytes(url, param, kind="video", media_types=VIDEO_MEDIA_TYPES, formats=_FORMATS)


def _av(param: str):
    try:
        import av
    except ImportError:
        raise RequestError("this server cannot decode video files (PyAV is not installed: pip install "
                           "'hydrad[video]'); send the frames as images instead", param=param) from None
    return av


def _open(data: bytes, param: str):
    av = _av(param)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, EOFError):
        raise RequestError(f"the data is not a video file that can be read ({_FORMATS}), or it is truncated",
                           param=param) from None
    if not container.streams.video:
        container.close()
        raise RequestError("the video file has no video stream", param=param)
    return container


def read_header(data: bytes, *, max_pixels: int, param: str) -> VideoHeader:
    """The frame count, rate and size of a video file, from its container (frames counted from
    their packets where the container does not say), the frame size checked against
    ``max_pixels``."""
    av = _av(param)
    container = _open(data, param)
    try:
        stream = container.streams.video[0]
        width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
        if width <= 0 or height <= 0:
            raise RequestError("the video file does not say its frame size", param=param)
        if width * height > max_pixels:
            raise RequestError(f"the video's frames are {width}x{height} = {width * height} pixels; the limit is "
                               f"{max_pixels}", param=param)
        rate = stream.average_rate or stream.guessed_rate
        num_frames = int(stream.frames or 0)
        if num_frames <= 0:
            try:
                num_frames = sum(1 for packet in container.demux(stream) if packet.size)
            except av.FFmpegError:
                raise RequestError("the video file is damaged or truncated", param=param) from None
        if num_frames <= 0:
            raise RequestError("the video file has no frames", param=param)
        return VideoHeader(num_frames, float(rate) if rate else None, width, height)
    finally:
        container.close()


def decode_video(data: bytes, sampling: VideoSampling, *, max_pixels: int, param: str) -> VideoClip:
    """The sampled frames of a video file (``sample_indices``), decoded as RGB."""
    av = _av(param)
    header = read_header(data, max_pixels=max_pixels, param=param)
    indices = sample_indices(header.num_frames, header.fps, sampling)
    wanted = set(indices)
    kept: dict[int, np.ndarray] = {}
    container = _open(data, param)
    try:
        for i, frame in enumerate(container.decode(video=0)):
            if i in wanted:
                kept[i] = frame.to_ndarray(format="rgb24")
            if i >= indices[-1]:
                break
    except av.FFmpegError:
        raise RequestError("the video file is damaged or truncated", param=param) from None
    finally:
        container.close()
    if not kept:
        raise RequestError("no frame of the video file could be decoded", param=param)
    # A container whose packets outnumber its frames ends early: its last frame stands in.
    last = kept[max(kept)]
    frames = np.stack([kept.get(i, last) for i in indices])
    fps = len(indices) / header.num_frames * header.fps if header.fps else DEFAULT_FRAMES_FPS
    return VideoClip(frames, fps, source=data, sampling=sampling)


def frames_clip(frames, fps: float | None, *, max_frames: int, max_pixels: int, param: str) -> VideoClip:
    """Frames given as objects: a list of PIL images or an array [frames, height, width, 3] of
    uint8, at ``fps`` frames per second (transformers' 24 when not said)."""
    from PIL import Image

    if isinstance(frames, np.ndarray):
        array = frames
    elif isinstance(frames, (list, tuple)) and frames and all(isinstance(f, Image.Image) for f in frames):
        if len({f.size for f in frames}) != 1:
            raise RequestError("a video's frames must all have one size", param=param)
        array = np.stack([np.asarray(f if f.mode == "RGB" else f.convert("RGB")) for f in frames])
    else:
        raise RequestError("a video must be a non-empty list of PIL images or a uint8 array "
                           "[frames, height, width, 3]", param=param)
    if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8 or not all(array.shape):
        raise RequestError(f"a video array must be uint8 [frames, height, width, 3], got {array.dtype} "
                           f"{list(array.shape)}", param=param)
    if len(array) > max_frames:
        raise RequestError(f"the video has {len(array)} frames; the limit is {max_frames}", param=param)
    height, width = array.shape[1:3]
    if width * height > max_pixels:
        raise RequestError(f"the video's frames are {width}x{height} = {width * height} pixels; the limit is "
                           f"{max_pixels}", param=param)
    if fps is not None and not (isinstance(fps, (int, float)) and fps > 0):
        raise RequestError("a video's fps must be a positive number", param=param)
    return VideoClip(np.ascontiguousarray(array), float(fps or DEFAULT_FRAMES_FPS))
