"""Qwen2-VL and Qwen2.5-VL videos: frames sampled from a file, processed as transformers'
video processor processes them, placed in the prompt with their M-RoPE positions, and the
greedy tokens of a prompt with a video against transformers' ``generate``.

transformers' video processor needs torchvision; where it is installed the processing and the
frame sampling are compared with it bit for bit (the tests that need it skip elsewhere).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factories import hf_greedy_logprobs, hf_model, image, mp4, photo_frames, text, video_hf_inputs, video_url

from hydrad.errors import RequestError
from hydrad.models.qwen2_vl import get_mrope_positions
from hydrad.models.qwen2_vl_videos import DEFAULTS, Qwen2VLVideos
from hydrad.processor import InputProcessor
from hydrad.videos import EncodedVideo, VideoSampling, decode_video, read_header, sample_indices

av = pytest.importorskip("av")

ARCHS = ("qwen2-vl", "qwen2.5-vl")


# -- against transformers' video processor (needs torchvision) ------------------------------------
@pytest.mark.parametrize("size", [None, {"shortest_edge": 3136, "longest_edge": 200704},
                                  {"shortest_edge": 3136, "longest_edge": 12544}])
def test_processing_is_transformers_own(size):
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLVideoProcessor

    settings = {} if size is None else {"size": size}
    reference = Qwen2VLVideoProcessor(**settings)
    ours = Qwen2VLVideos({**DEFAULTS, **settings})
    for seed, (num, height, width) in enumerate([(4, 48, 64), (5, 120, 90), (8, 224, 224), (3, 300, 500),
                                                 (1, 60, 80), (6, 512, 512)]):
        frames = photo_frames(num, height, width, seed)
        kwargs = {"cap_pixels_per_frame": False} if "cap_pixels_per_frame" in reference.valid_kwargs.__annotations__ \
            else {}
        expected = reference(videos=[list(frames)], return_tensors="pt", do_sample_frames=False, **kwargs)
        got = ours(frames)
        assert got.grid_thw == tuple(expected["video_grid_thw"][0].tolist())
        assert torch.equal(got.pixel_values, expected["pixel_values_videos"]), (num, height, width)


def test_frame_sampling_is_transformers_own():
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    reference = Qwen2VLVideoProcessor()
    for total, fps in [(25, 10.0), (300, 30.0), (7, 2.0), (61, 29.97), (4, 1.0), (1000, 25.0), (3, 24.0)]:
        for max_frames in (8, 32):
            sampling = VideoSampling(fps=2.0, min_frames=4, max_frames=max_frames, temporal_patch=2)
            expected = reference.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), fps=2,
                                               max_frames=max_frames).tolist()
            assert sample_indices(total, fps, sampling) == expected, (total, fps, max_frames)


# -- decoding --------------------------------------------------------------------------------------
def test_a_file_is_sampled_at_the_video_frame_rate():
    # Frame i is a flat grey of 8 * i: which frames were kept reads off their values.
    frames = np.stack([np.full((48, 64, 3), 8 * i, np.uint8) for i in range(25)])
    data = mp4(frames, fps=10)
    header = read_header(data, max_pixels=10**6, param="p")
    assert (header.num_frames, header.fps, header.width, header.height) == (25, 10.0, 64, 48)
    sampling = VideoSampling(fps=2.0, min_frames=4, max_frames=32, temporal_patch=2)
    clip = decode_video(data, sampling, max_pixels=10**6, param="p")
    # 2.5 s at 2 frames a second: 5, down to a multiple of the temporal patch.
    kept = sample_indices(25, 10.0, sampling)
    assert kept == [0, 6, 12, 18]
    assert clip.frames.shape == (4, 48, 64, 3)
    assert np.abs(clip.frames.reshape(4, -1).mean(axis=1) - 8 * np.array(kept)).max() < 3
    assert clip.fps == pytest.approx(4 / 25 * 10.0)
    # Fewer frames allowed: evenly spread over the video.
    few = decode_video(data, VideoSampling(fps=8.0, min_frames=4, max_frames=8, temporal_patch=2),
                       max_pixels=10**6, param="p")
    assert len(few.frames) == 8


@pytest.mark.parametrize("data, message", [
    (b"not a video at all" * 100, "not a video file that can be read"),
    (None, "not a video file that can be read"),  # a file cut short
])
def test_a_bad_file_is_one_clear_error(data, message):
    if data is None:
        data = mp4(photo_frames(6, 48, 64, 0), fps=10)[:300]
    with pytest.raises(RequestError, match=message):
        decode_video(data, VideoSampling(), max_pixels=10**6, param="messages[0].content[0]")


def test_frames_over_the_pixel_limit_are_refused_from_the_header():
    data = mp4(photo_frames(4, 96, 128, 0), fps=10)
    with pytest.raises(RequestError, match=r"128x96 = 12288 pixels; the limit is 10000"):
        read_header(data, max_pixels=10_000, param="p")


# -- prompts and positions -------------------------------------------------------------------------
@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, arch):
    return tiny_checkpoint(arch)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return InputProcessor(checkpoint, max_video_frames=16)


def _conversation(fps: float | None) -> list[dict]:
    video = {"type": "video", "video": photo_frames(6, 90, 120, 1)}
    if fps is not None:
        video["fps"] = fps
    return [
        {"role": "user", "content": [image(80, 64, 3), text("and then")]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [video, text("What happens in the video?")]},
    ]


def test_a_video_takes_its_tokens_and_positions(processor, checkpoint, arch):
    prompt = processor.process_chat(_conversation(fps=None))
    ids = prompt.prompt_token_ids
    video = prompt.images[1]
    assert [item.offset for item in prompt.images] == sorted(item.offset for item in prompt.images)
    assert video.grid_thw[0] == 3  # six frames, two a group
    # The tower attends within each group of frames (the latency model's square term), within
    # the whole of an image.
    t, h, w = video.grid_thw
    assert (video.num_patches, video.attention_span, video.frames) == (t * h * w, h * w, 6)
    assert prompt.images[0].frames == 0
    assert prompt.images[0].attention_span == prompt.images[0].num_patches
    assert ids[video.offset: video.offset + video.length] == [processor.video_token_id] * video.length
    assert ids.count(processor.video_token_id) == video.length
    # transformers' own positions (where its rule and Qwen's agree: the video's times stay
    # within its sides).
    hf = hf_model(checkpoint)
    inputs = video_hf_inputs(processor, prompt)
    extra = {"second_per_grid_ts": torch.tensor([2 / 24.0])} if arch == "qwen2.5-vl" else {}
    positions, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                               image_grid_thw=inputs["image_grid_thw"],
                                               video_grid_thw=inputs["video_grid_thw"], **extra)
    assert torch.equal(positions[:, 0], prompt.mrope_positions)
    assert int(delta) == prompt.mrope_delta


def test_a_videos_groups_encode_as_the_whole_video(processor, checkpoint):
    """The engine encodes a video group by group (``ImageInput.groups``): its groups of frames
    split its pixels, tokens and grid, and the tower (Qwen2.5-VL's windows too) and merger
    give each group's tokens exactly as over the whole video; an image stays one input."""
    from vlm_cases import load_ours

    from hydrad.models.loader import load_config
    from hydrad.models.registry import get_model_class

    prompt = processor.process_chat(_conversation(fps=None))
    picture, video = prompt.images
    assert picture.groups() == [picture] and video.num_groups == 3
    groups = video.groups()
    t, h, w = video.grid_thw
    assert [g.grid_thw for g in groups] == [(1, h, w)] * 3
    assert [(g.offset, g.length) for g in groups] == [(video.offset + k * h * w // 4, h * w // 4) for k in range(3)]
    assert [(g.num_patches, g.attention_span, g.frames) for g in groups] == [(h * w, h * w, 2)] * 3
    assert torch.equal(torch.cat([g.pixel_values for g in groups]), video.pixel_values)
    digests = [g.content_hash for g in groups]
    assert len(set(digests + [video.content_hash])) == 4 and None not in digests
    assert [g.content_hash for g in video.groups()] == digests  # the same video, the same groups
    assert groups[1].groups() == [groups[1]]
    model = load_ours(get_model_class(load_config(checkpoint)), checkpoint)
    (whole,) = model.encode_images([video])
    torch.testing.assert_close(torch.cat(model.encode_images(groups)), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model.encode_images(groups[2:])[0], whole[2 * h * w // 4:], atol=1e-6, rtol=1e-6)


def test_text_after_a_long_video_resumes_past_it():
    # 12 groups of frames over a 2 x 2 grid of merged patches: the times run to 11, past the sides.
    ids = [1, 2] + [9] * 48 + [3, 4]
    positions, delta = get_mrope_positions(ids, 8, [], 2, video_token_id=9, video_grid_thw=[(12, 4, 4)],
                                           video_time_intervals=[1.0])
    video = positions[:, 2:50]
    assert video[0].tolist() == [2 + t for t in range(12) for _ in range(4)]
    assert int(video.max()) == 13
    assert positions[:, 50:].tolist() == [[14, 15]] * 3  # one past the largest, in all three rows
    assert delta == 16 - len(ids)
    # Qwen2.5-VL's spacing: int(k * interval).
    spaced, _ = get_mrope_positions(ids, 8, [], 2, video_token_id=9, video_grid_thw=[(12, 4, 4)],
                                    video_time_intervals=[2.5])
    assert spaced[0, 2:50:4].tolist() == [2 + int(k * 2.5) for k in range(12)]


@pytest.mark.parametrize("fps", [None, 3.0])
def test_greedy_tokens_with_a_video_equal_transformers(checkpoint, processor, arch, fps):
    from hydrad import LLM, SamplingParams

    conversation = _conversation(fps)
    prompt = processor.process_chat(conversation)
    inputs = video_hf_inputs(processor, prompt)
    if arch == "qwen2.5-vl":
        inputs["second_per_grid_ts"] = torch.tensor([2 / (fps or 24.0)])
    expected, _ = hf_greedy_logprobs(hf_model(checkpoint), inputs, 12)
    llm = LLM(str(checkpoint), devices="cpu:1", worker_processes=False, kv_cache_memory_mb=16,
              image_cache_memory_mb=8)
    try:
        out = llm.chat([conversation], SamplingParams(max_tokens=12, min_tokens=12, temperature=0))
    finally:
        llm.shutdown()
    assert out[0].outputs[0].token_ids == expected


def test_video_errors_are_clear(processor, tiny_checkpoint):
    user = lambda *parts: [{"role": "user", "content": list(parts)}]  # noqa: E731
    frames = photo_frames(4, 48, 64, 0)
    with pytest.raises(RequestError, match="the video has 20 frames; the limit is 16"):
        processor.process_chat(user({"type": "video", "video": photo_frames(20, 48, 64, 0)}))
    with pytest.raises(RequestError, match="remote video URLs are not enabled on this server"):
        processor.process_chat(user({"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}))
    with pytest.raises(RequestError, match="unsupported video media type 'image/png'"):
        processor.process_chat(user({"type": "video_url", "video_url": {"url": "data:image/png;base64,AAAA"}}))
    with pytest.raises(RequestError, match="fps must be a positive number"):
        processor.process_chat(user({"type": "video", "video": frames, "fps": 0}))
    with pytest.raises(RequestError, match="videos are accepted in user messages only"):
        processor.process_chat([{"role": "assistant", "content": [{"type": "video", "video": frames}]}])
    llava = InputProcessor(tiny_checkpoint("llava"))
    with pytest.raises(RequestError, match=r"this model \(llava\) does not take videos"):
        llava.process_chat(user({"type": "video", "video": frames}))
    # A video file's kept frames count against the request's pixels, read from its header.
    small = InputProcessor(processor.model_path, max_request_pixels=5 * 64 * 48, max_image_pixels=64 * 48)
    data = mp4(photo_frames(30, 48, 64, 0), fps=10)  # 3 s: 6 frames kept
    with pytest.raises(RequestError, match="6 images and video frames have 18432 pixels"):
        small.inspect_chat(user({"type": "video_url", "video_url": {"url": video_url(data)}}))


def test_unserved_video_settings_refuse_videos_not_images(checkpoint, tmp_path):
    import json
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "processor_config.json").read_text())
    config["video_processor"]["resample"] = 2  # bilinear
    (copy / "processor_config.json").write_text(json.dumps(config))
    processor = InputProcessor(copy)
    assert processor.process_chat([{"role": "user", "content": [image(80, 64, 3), text("Hi")]}]).images
    with pytest.raises(RequestError, match="video processor settings are not served, so it takes no videos"):
        processor.process_chat([{"role": "user", "content": [{"type": "video", "video": photo_frames(4, 48, 64, 0)}]}])


def test_a_video_file_in_a_request(processor):
    data = mp4(photo_frames(30, 48, 64, 2), fps=10)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_url(data)}},
                                             text("Describe it.")]}]
    size = processor.inspect_chat(messages)
    assert size.image_sizes == ((64, 48),) * 6
    prompt = processor.process_chat(messages)
    (video,) = prompt.images
    assert video.grid_thw[0] == 3 and video.image_size == (48, 64)
    # A video fetched from a remote URL (the daemon's fetch hands over its bytes) is the same video.
    fetched = [{"role": "user", "content": [{"type": "video", "video": EncodedVideo(data)}, text("Describe it.")]}]
    assert processor.process_chat(fetched).prompt_token_ids == prompt.prompt_token_ids
    # The digest is the file's and the sampling's: the same file again finds it, another sampling not.
    assert processor.process_chat(messages).images[0].content_hash == video.content_hash
    other = InputProcessor(processor.model_path, max_video_frames=4)
    assert other.process_chat(messages).images[0].content_hash != video.content_hash
