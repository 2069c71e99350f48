import base64
import io
import numpy as np
import pytest
from PIL import Image

from hydrad.bench.arrivals import Trace
from hydrad.bench.images import file_data_url, image_data_url, synth_image
from hydrad.bench.videos import video_file_data_url
from hydrad.bench.workloads import PROFILES, ChatWorkload, SynthImage, SynthVideo, TraceTextWorkload, load_workload
from hydrad.errors import ConfigError


def decode(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


@pytest.mark.parametrize("name", ["textcaps", "pope", "mme", "textvqa", "vizwiz"])
def test_vision_profiles_send_one_image_within_their_ranges(name):
    profile, workload = PROFILES[name], load_workload(name, seed=0)
    for i in range(50):
        spec = workload.request(i, salt=0)
        assert len(spec.images) == 1
        assert (spec.images[0].width, spec.images[0].height) in profile.image_sizes
        assert profile.prompt_tokens[0] <= len(spec.prompt.split()) <= profile.prompt_tokens[1]
        assert profile.output_tokens[0] <= spec.output_tokens <= profile.output_tokens[1]


def test_chat_turns_repeat_the_conversation_so_far():
    workload = load_workload("chat:pope:3", seed=0)
    assert isinstance(workload, ChatWorkload) and workload.window == 32
    # Requests 0..31 are the first turns of conversations 0..31, 32..63 their second turns, ...;
    # then conversations 32..63.
    assert [workload.position(i) for i in (0, 31, 32, 95, 96)] == [(0, 0), (31, 0), (0, 1), (31, 2), (32, 0)]
    first, second, third = (workload.request(i, salt=5) for i in (7, 39, 71))
    assert first.images == second.images == third.images and len(first.images) == 1
    assert second.prompt.startswith(first.prompt + " ") and third.prompt.startswith(second.prompt + " ")
    # The answer between two questions has the earlier turn's output length.
    pope = PROFILES["pope"]
    added = len(second.prompt.split()) - len(first.prompt.split())
    assert first.output_tokens + pope.prompt_tokens[0] <= added <= first.output_tokens + pope.prompt_tokens[1]
    other = workload.request(8, salt=5)
    assert other.images != first.images and not other.prompt.startswith(first.prompt)
    assert workload.request(39, salt=6).images != second.images  # fresh per salt
    assert not load_workload("chat:text:2", seed=0).request(0, 0).images
    assert load_workload("chat:pope:2:256", seed=0).position(256) == (0, 1)


def test_text_profile_has_no_images():
    assert all(not load_workload("text", 0).request(i, 0).images for i in range(20))


def test_requests_are_deterministic_per_seed_and_fresh_per_salt():
    a, b, c = load_workload("pope", 1), load_workload("pope", 1), load_workload("pope", 2)
    assert [a.request(i, 0) for i in range(5)] == [b.request(i, 0) for i in range(5)]
    assert [a.request(i, 0) for i in range(5)] != [c.request(i, 0) for i in range(5)]
    assert a.request(0, 0).images != a.request(0, 1).images


def test_mix_follows_its_weights():
    workload = load_workload("mix:text=0.8,vizwiz=0.2", seed=0)
    with_image = sum(bool(workload.request(i, 0).images) for i in range(1000))
    assert 150 <= with_image <= 250


@pytest.mark.parametrize("spec", ["nope", "mix:textcaps=0.5,nope=0.5", "mix:textcaps=-1", "mix:textcaps", "chat:pope",
                                  "chat:nope:2", "chat:pope:0", "chat:pope:x", "chat:pope:2:0",
                                  "chat:pope:2:3:4"])
def test_bad_specs_are_config_errors(spec):
    with pytest.raises(ConfigError):
        load_workload(spec, 0)


def test_jsonl_workload(tmp_path, write_jsonl):
    Image.new("RGB", (32, 24), "red").save(tmp_path / "cat.png")
    path = write_jsonl([
        {"timestamp": 2.0, "prompt": "second", "output_tokens": 3, "images": ["cat.png"]},
        {"timestamp": 0.5, "prompt_tokens": 7, "output_tokens": 5, "images": [{"width": 64, "height": 48}]},
    ])
    workload = load_workload(str(path), seed=0)
    assert workload.timestamps == (0.5, 2.0)
    first, second = workload.request(0, 0), workload.request(1, 0)
    assert len(first.prompt.split()) == 7 and first.output_tokens == 5
    assert isinstance(first.images[0], SynthImage) and (first.images[0].width, first.images[0].height) == (64, 48)
    assert second.prompt == "second" and second.images == (str(tmp_path / "cat.png"),)
    cycled = workload.request(2, 0)  # the first entry again, with freshly generated content
    assert len(cycled.prompt.split()) == 7 and cycled.output_tokens == 5 and cycled.images != first.images
    assert decode(file_data_url(second.images[0])).size == (32, 24)


def test_jsonl_videos(tmp_path, write_jsonl):
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    path = write_jsonl([{"prompt": "v", "output_tokens": 2,
                         "videos": [{"frames": 8, "width": 320, "height": 240}, "clip.mp4"]}])
    workload = load_workload(str(path), seed=0)
    first = workload.request(0, 0)
    synth, file = first.videos
    assert isinstance(synth, SynthVideo) and (synth.frames, synth.width, synth.height, synth.fps) == (8, 320, 240, 2.0)
    assert file == str(tmp_path / "clip.mp4") and first.images == ()
    assert workload.request(1, 0).videos[0].seed != synth.seed  # fresh content when cycled
    assert video_file_data_url(file).startswith("data:video/mp4;base64,")


def test_a_scoring_line_asks_for_its_prompts_log_probabilities(write_jsonl):
    import json

    from hydrad.bench.client import chat_payload

    path = write_jsonl([{"prompt_tokens": 30, "output_tokens": 1, "prompt_logprobs": True},
                        {"prompt_tokens": 30, "output_tokens": 4}])
    workload = load_workload(str(path), seed=0)
    scoring, plain = workload.request(0, 0), workload.request(1, 0)
    assert scoring.prompt_logprobs and not plain.prompt_logprobs
    assert json.loads(chat_payload("m", scoring, []))["prompt_logprobs"] == 1
    assert "prompt_logprobs" not in json.loads(chat_payload("m", plain, []))


def test_a_line_with_n_asks_for_that_many_completions_whole(write_jsonl):
    import json

    from hydrad.bench.client import chat_payload

    path = write_jsonl([{"prompt_tokens": 30, "output_tokens": 4, "n": 3}, {"prompt_tokens": 30, "output_tokens": 4}])
    workload = load_workload(str(path), seed=0)
    several, one = workload.request(0, 0), workload.request(1, 0)
    assert several.n == 3 and one.n == 1
    payload = chat_payload("m", several, [], {"temperature": 1.0})
    body = json.loads(payload)
    assert body["n"] == 3 and body["stream"] is False and "stream_options" not in body
    assert payload.output_tokens == 12  # the answer must hold every completion's tokens
    body = json.loads(chat_payload("m", one, []))
    assert "n" not in body and body["stream"] is True


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "x"}, "output_tokens"),
        ({"prompt": "x", "prompt_tokens": 3, "output_tokens": 1}, "exactly one"),
        ({"prompt": "x", "output_tokens": 1, "images": ["missing.jpg"]}, "not found"),
        ({"prompt": "x", "output_tokens": 1, "images": [{"width": 0, "height": 5}]}, "width"),
        ({"prompt": "x", "output_tokens": 1, "timestamp": "soon"}, "timestamp"),
        ({"prompt": "x", "output_tokens": 1, "videos": [{"frames": 4, "width": 8, "height": 8, "fps": 0}]}, "fps"),
        ({"prompt": "x", "output_tokens": 1, "videos": [{"width": 8, "height": 8}]}, "video frames"),
        ({"prompt": "x", "output_tokens": 1, "videos": ["missing.mp4"]}, "video file 'missing.mp4' not found"),
        ({"prompt": "x", "output_tokens": 1, "videos": [7]}, "a video is a file path"),
        ({"prompt": "x", "output_tokens": 1, "prompt_logprobs": 1}, "'prompt_logprobs' must be true or false"),
        ({"prompt": "x", "output_tokens": 1, "n": 0}, "'n' must be a positive integer"),
    ],
)
def test_bad_jsonl_lines_name_the_line(write_jsonl, row, message):
    path = write_jsonl([{"prompt": "ok", "output_tokens": 1}, row])
    with pytest.raises(ConfigError, match=f"workload.jsonl:2: .*{message}"):
        load_workload(str(path), 0)


def test_unreadable_workload_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_workload(str(tmp_path / "absent.jsonl"), 0)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1: invalid JSON"):
        load_workload(str(tmp_path / "bad.jsonl"), 0)


def test_trace_lengths_and_shared_prefixes_for_text():
    trace = Trace((0.0, 1.0, 2.0), input_lengths=(600, 1000, 5), output_lengths=(4, 0, 2),
                  hash_ids=((7, 8), (7, 9), ()))
    workload = load_workload("text", seed=0, trace=trace)
    assert isinstance(workload, TraceTextWorkload)
    a, b, c = (workload.request(i, 0).prompt.split() for i in range(3))
    assert (len(a), len(b), len(c)) == (600, 1000, 5)
    assert a[:512] == b[:512] and a[512:] != b[512:600]
    assert [workload.request(i, 0).output_tokens for i in range(3)] == [4, 1, 2]


def test_synthetic_images_are_photo_like_and_deterministic():
    image = synth_image(1296, 968, seed=3)
    pixels = np.asarray(image, dtype=np.float32)
    assert image.size == (1296, 968) and image.mode == "RGB"
    assert pixels.std() > 20  # not blank
    assert np.abs(np.diff(pixels, axis=1)).mean() > 1  # grain, not flat fills
    assert np.array_equal(pixels, np.asarray(synth_image(1296, 968, seed=3)))
    assert not np.array_equal(pixels, np.asarray(synth_image(1296, 968, seed=4)))


@pytest.mark.parametrize("fmt, pil_format", [("jpeg", "JPEG"), ("png", "PNG")])
def test_data_urls_decode_to_the_requested_size(fmt, pil_format):
    url = image_data_url(synth_image(640, 480, seed=0), fmt)
    assert url.startswith(f"data:image/{fmt};base64,")
    decoded = decode(url)
    assert decoded.format == pil_format and decoded.size == (640, 480)


def test_profiles_cover_the_five_datasets_and_text():
    assert set(PROFILES) == {"textcaps", "pope", "mme", "textvqa", "vizwiz", "text"}
    for profile in PROFILES.values():
        assert profile.prompt_tokens[0] <= profile.prompt_tokens[1]
        assert 1 <= profile.output_tokens[0] <= profile.output_tokens[1]
