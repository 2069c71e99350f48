"""Synthetic videos and data URLs for video inputs.

A synthetic video is a photo-like picture (``images.synth_image``) panning a few pixels a
frame, encoded as H.264 in MP4 with PyAV (the ``video`` extra): a vision encoder's cost
follows the frames kept and their size, and a real codec's file keeps the server's
decoding cost real too.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np

from hydrad.bench.images import file_data_url, synth_image
from hydrad.bench.workloads import SynthVideo
from hydrad.errors import ConfigError

_PAN_PIXELS = 4  # per frame


def synth_video(video: SynthVideo) -> bytes:
    """A deterministic MP4 file for ``video``."""
    try:
        import av
    except ImportError:
        raise ConfigError("video workloads need PyAV: pip install 'hydrad[video]'") from None
    base = np.asarray(synth_image(video.width, video.height, video.seed))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=round(video.fps) if float(video.fps).is_integer() else video.fps)
        # H.264 in 4:2:0 wants even sides: a video of odd size is cropped by a pixel.
        stream.width, stream.height = video.width - video.width % 2, video.height - video.height % 2
        stream.pix_fmt = "yuv420p"
        for i in range(video.frames):
            frame = np.roll(base, _PAN_PIXELS * i, axis=1)[: stream.height, : stream.width]
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def video_data_url(video: SynthVideo) -> str:
    return "data:video/mp4;base64," + base64.b64encode(synth_video(video)).decode("ascii")


def video_file_data_url(path: str | Path) -> str:
    """The video file's bytes as a data URL, so the server needs no access to the client's disk."""
    return file_data_url(path, "video")
