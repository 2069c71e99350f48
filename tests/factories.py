"""Reusable builders for tests: tiny checkpoints and the same weights in every on-disk layout;
conversations with images of many sizes and transformers' greedy references for them."""

from __future__ import annotations

import base64
import io
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from hydrad.models.builder import SAFETENSORS_INDEX, build_model, write_weights

# Layout fixture name -> (writer layout, max shard size in bytes). The tiny model holds ~0.7 MB
# of weights, so 300 kB gives three shards.
LAYOUTS: dict[str, tuple[str, int | None]] = {
    "hub": ("hub", None),
    "hf5": ("hf5", None),
    "module": ("module", None),
    "hub-sharded": ("hub", 300_000),
}


def make_tiny_llava(out_dir: Path, seed: int = 0) -> Path:
    return build_model(out_dir, "llava", "tiny", seed, progress=False)


def make_tiny(out_dir: Path, arch: str, seed: int = 0, layout: str = "hf5") -> Path:
    """A tiny checkpoint of ``arch`` (a ``hydrad make-model --arch`` name) as ``hydrad make-model`` writes it."""
    return build_model(out_dir, arch, "tiny", seed, layout=layout, progress=False)


def hf_model(path: Path):
    """transformers' model of the checkpoint at ``path`` (its config's architecture), in eval mode."""
    import transformers

    from hydrad.models.loader import load_config

    return getattr(transformers, load_config(path).architectures[0]).from_pretrained(path).eval()


def module_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as transformers holds them in memory (``model.language_model.*``, ...)."""
    return dict(hf_model(path).state_dict())


def canonical_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The reference for the loader: in-memory names without the leading ``model.``."""
    return {name.removeprefix("model."): t for name, t in module_state_dict(path).items()}


def is_weight_file(path: Path) -> bool:
    return path.name == SAFETENSORS_INDEX or path.suffix == ".safetensors"


def copy_without_weights(src_dir: Path, out_dir: Path) -> Path:
    """``src_dir``'s config, tokenizer and processor files, without any weight file."""
    out_dir.mkdir(parents=True)
    for path in src_dir.iterdir():
        if not is_weight_file(path):
            shutil.copy2(path, out_dir / path.name)
    return out_dir


def make_layout(
    src_dir: Path,
    out_dir: Path,
    state_dict: Mapping[str, torch.Tensor],
    layout: str,
    max_shard_size: int | None = None,
    model_type: str = "llava",
) -> Path:
    """A complete checkpoint: ``src_dir``'s other files and ``state_dict`` (in-memory names) in ``layout``."""
    copy_without_weights(src_dir, out_dir)
    write_weights(state_dict, out_dir, layout, max_shard_size=max_shard_size, model_type=model_type)
    return out_dir


def weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".safetensors")


# Every deployment method the tests run end to end: (deploy spec, devices).
DEPLOYMENTS = [
    ("1E+1P+1D", "cpu:3"),
    ("1EP+1D", "cpu:2"),
    ("1ED+1P", "cpu:2"),
    ("1E+1PD", "cpu:2"),
    ("2EPD", "cpu:2"),
    ("1E+1EP+1D", "cpu:3"),
]


class RecordingSink:
    """A request sink that records what reaches it: ("token", id, logprobs),
    ("finish", reason, stage_times) and ("error", exception)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_token(self, token_id, logprobs) -> None:
        self.events.append(("token", token_id, logprobs))

    def on_finish(self, finish_reason, stage_times, num_cached_tokens=0) -> None:
        self.events.append(("finish", finish_reason, stage_times))

    def on_error(self, error) -> None:
        self.events.append(("error", error))

    @property
    def tokens(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "token"]

    @property
    def ended(self) -> tuple | None:
        return next((e for e in self.events if e[0] in ("finish", "error")), None)

    async def until_ended(self, timeout: float = 5.0) -> tuple:
        import asyncio

        for _ in range(int(timeout / 0.01)):
            if self.ended is not None:
                return self.ended
            await asyncio.sleep(0.01)
        raise AssertionError(f"no end within {timeout} s: {self.events}")


# -- conversations and transformers' references ---------------------------------------------------
# The images are noise of many sizes and aspect ratios, so each one has its own number of image
# tokens (LLaVA-NeXT: its tile grid and unpadding; Qwen2-VL: its resized patch grid). References
# run transformers on the checkpoint's own processor outputs, one conversation at a time.
NUM_NEW_TOKENS = 8


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image(width: int, height: int, seed: int) -> dict:
    return {"type": "image", "image": noise(width, height, seed)}


def photo_frames(num: int, height: int, width: int, seed: int) -> np.ndarray:
    """A photograph resized to the frame size, each frame shifted and noised differently."""
    from PIL import Image
    from skimage import data

    rng = np.random.default_rng(seed)
    base = np.asarray(Image.fromarray(data.astronaut()).resize((width, height), Image.BICUBIC)).astype(np.int32)
    frames = [np.roll(base, 3 * i, axis=1) + rng.integers(-12, 12, base.shape) for i in range(num)]
    return np.clip(np.stack(frames), 0, 255).astype(np.uint8)


def mp4(frames: np.ndarray, fps: int) -> bytes:
    """An H.264 file of ``frames`` (PyAV)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def video_hf_inputs(processor, prompt) -> dict:
    """transformers' model inputs for a prompt with videos as hydrad processed it: its pixels
    (tests/models/test_qwen2_vl_videos.py compares the processing with transformers'), its
    token ids and their modality."""
    ids = torch.tensor([prompt.prompt_token_ids])
    kinds = torch.zeros_like(ids)
    kinds[ids == processor.image_token_id] = 1
    kinds[ids == processor.video_token_id] = 2
    is_video = [int(ids[0, item.offset]) == processor.video_token_id for item in prompt.images]
    videos = [item for item, v in zip(prompt.images, is_video) if v]
    images = [item for item, v in zip(prompt.images, is_video) if not v]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": kinds,
              "pixel_values_videos": torch.cat([v.pixel_values for v in videos]),
              "video_grid_thw": torch.tensor([v.grid_thw for v in videos])}
    if images:
        inputs.update(pixel_values=torch.cat([i.pixel_values for i in images]),
                      image_grid_thw=torch.tensor([i.grid_thw for i in images]))
    return inputs


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def conversations() -> list[list[dict]]:
    """Two images of different aspect ratios in one turn, one image after text, text only, multi-turn."""
    return [
        [{"role": "user", "content": [image(100, 60, 1), text("Compare these two:"), image(60, 150, 2)]}],
        [{"role": "user", "content": [text("What is this?"), image(200, 200, 3)]}],
        [{"role": "user", "content": "Tell me a story about a brave little robot."}],
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": [image(300, 90, 4), text("What is in the picture?")]},
            {"role": "assistant", "content": "A long red bus."},
            {"role": "user", "content": "And its colour?"},
        ],
        [{"role": "user", "content": [image(30, 20, 5), image(90, 140, 6), text("Two images, side by side.")]}],
    ]


def hf_inputs(hf_processor, conversation: list[dict]) -> dict[str, torch.Tensor]:
    """The checkpoint's processor outputs for ``conversation`` (images as parts of the messages)."""
    images, messages = [], []
    for message in conversation:
        content = message["content"]
        if isinstance(content, str):
            content = [text(content)]
        parts = []
        for part in content:
            if part["type"] == "image":
                images.append(part["image"])
                parts.append({"type": "image"})
            else:
                parts.append(part)
        messages.append({"role": message["role"], "content": parts})
    prompt = hf_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(hf_processor(text=prompt, images=images or None, return_tensors="pt"))


def hf_greedy(hf, inputs: dict[str, torch.Tensor], num_new_tokens: int = NUM_NEW_TOKENS):
    """transformers' greedy continuation, and its logits at every position of prompt + continuation
    but the last: the prompt's from one forward, the continuation's as ``generate`` computed them."""
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        prompt_logits = hf(**inputs).logits[0]
    num_prompt = inputs["input_ids"].shape[1]
    # out.logits[k] (raw, before min_new_tokens masks EOS) predicts new token k from the token before it.
    logits = torch.cat([prompt_logits, *(step[:1] for step in out.logits[1:])])
    return out.sequences[0, num_prompt:].tolist(), logits


def mixed_conversations() -> list[list[dict]]:
    """``conversations()`` and four more: a tall image, a short text-only prompt, an image in a
    later turn of a conversation that had one before, a tiny image under a long text."""
    return conversations() + [
        [{"role": "user", "content": [image(40, 300, 7), text("Describe this tall picture.")]}],
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": [image(120, 120, 8), text("What is this?")]},
            {"role": "assistant", "content": "A square."},
            {"role": "user", "content": [text("And this one?"), image(250, 100, 9)]},
        ],
        [{"role": "user", "content": [image(20, 20, 10), text("A tiny image. " * 12)]}],
    ]


def hf_greedy_logprobs(hf, inputs: dict[str, torch.Tensor], num_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of exactly ``num_new_tokens`` (EOS suppressed, as
    ``SamplingParams(min_tokens=...)`` does) and the log-probability of each new token under the raw
    logits. Position errors that leave the tokens of a tiny random model unchanged still move these."""
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def hf_references(path: Path, conversations: list[list[dict]],
                  num_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """``hf_greedy_logprobs`` of every conversation on the checkpoint at ``path``."""
    from hydrad.models.hf_processor import load_hf_processor
    from hydrad.models.loader import load_config

    hf = hf_model(path)
    processor = load_hf_processor(path, load_config(path).model_type)
    return [hf_greedy_logprobs(hf, hf_inputs(processor, conv), num_new_tokens) for conv in conversations]


@contextmanager
def http_get_stub(answer: Callable[[str], bytes | None], content_type: str = "application/json",
                  post: Callable[[str, bytes], bytes | None] | None = None) -> Iterator[str]:
    """A loopback HTTP server while the block runs, its root URL yielded: each GET is answered
    200 with ``answer(path)``, or 404 where that is None; each POST likewise with
    ``post(path, body)`` (404 without ``post``)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._send(post(self.path, data) if post is not None else None)

        def do_GET(self):
            self._send(answer(self.path))

        def _send(self, body: bytes | None):
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet: the tests read what was served, not a log
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# Cache pools of fixed sizes for the CUDA tests that put several instances on GPU 0: pools
# sized from its memory would give the first one nearly all of it (tests/cuda/test_cuda_memory.py
# and the daemon test on CUDA size them from the GPU).
FIXED_POOLS = dict(kv_cache_memory_mb=512, image_cache_memory_mb=256)


def open_paths(pid: int | str = "self") -> list[str]:
    """What each of process ``pid``'s descriptors is open on (one entry per descriptor)."""
    paths = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed since the listing (the listing's own descriptor, among others)
            pass
    return paths


class FakeGpuMemory:
    """Stands in for a GPU's memory readings (``hydrad.engine.memory``) so that an engine on the
    CPU sizes its pools as on a GPU: ``total`` bytes, ``free`` of them, ``reserved`` by this
    process (change it to stand for what an instance allocates), and each measured step
    ``step_peak`` bytes over what was reserved before it."""

    def __init__(self, monkeypatch, total: int, free: int, step_peak: int, reserved: int = 0):
        from hydrad.engine import memory

        self.total, self.free, self.step_peak, self.reserved = total, free, step_peak, reserved
        self._peak = reserved
        self.resets = 0
        on_a_gpu = memory.sized_from_device
        monkeypatch.setattr(memory, "sized_from_device", lambda cache, device: on_a_gpu(cache, torch.device("cuda")))
        monkeypatch.setattr(memory, "device_memory", self.read)
        monkeypatch.setattr(memory, "reset_peak", self.reset)

    def read(self, device):
        from hydrad.engine.memory import DeviceMemory

        reading = DeviceMemory(total=self.total, free=self.free, reserved=self.reserved, peak_reserved=self._peak)
        self._peak += self.step_peak  # the next reading comes after a step
        return reading

    def reset(self, device) -> None:
        self.resets += 1
        self._peak = self.reserved


def run_through(steps, between=lambda: None) -> tuple[int, object]:
    """Advance a measurement in steps (``StepThreads.fitting``, ``measuring_latency_model``) to
    its end, each step a probe run (it yields None) followed by ``between()`` (what the worker
    does between two runs); returns how many runs it yielded and what it returned."""
    runs = 0
    while True:
        try:
            assert next(steps) is None
        except StopIteration as stop:
            return runs, stop.value
        runs += 1
        between()


def place_every_instance_on_gpu0(monkeypatch) -> None:
    """``plan_instances`` placing every instance of the deploy spec on cuda:0 (also those asked
    for on a CPU): one GPU runs every deployment of roles."""
    import hydrad.cluster.deploy as deploy

    monkeypatch.setattr(deploy, "plan_instances",
                        lambda spec, devices, num_cuda: [(role, "cuda:0") for role in deploy.parse_deploy(spec)])
