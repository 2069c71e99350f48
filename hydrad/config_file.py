"""The daemon's configuration file (``etc/hydrad.toml``) and its server section.

The file has one table per config dataclass: ``[server]`` (with
``[server.remote_images]``), ``[model]``, ``[cache]``, ``[scheduler]``,
``[parallel]``, ``[slo]``, ``[trace]``, ``[planner]``, and a top-level ``seed``. Keys left out take the
dataclass defaults; unknown keys and wrongly typed values are errors, so a typo
never passes silently. A retired key (``_RETIRED``) is accepted with a warning that says
why it no longer does anything, so a file written for an earlier version still starts.
Command-line flags override the file (``overrides``, dotted keys such as
``"server.port"``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydrad.cluster.router import POLICIES
from hydrad.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, SLOConfig
from hydrad.errors import ConfigError

logger = logging.getLogger("hydrad.config")

ROUTER_POLICIES = POLICIES
# Keys that earlier versions read and this one ignores: dotted key -> why.
_RETIRED = {
    "slo.decode_context_len": "steps are sized by the fitted latency model, which covers every decode "
    "context; no batch is probed at a fixed context any more",
}
_LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class RemoteImageConfig:
    # Fetch http(s) image (and video) URLs. Off by default: a daemon that fetches URLs
    # given by clients can be made to reach hosts on its own network.
    enabled: bool = False
    max_bytes: int = 20 * 1024 * 1024
    timeout: float = 10.0
    # Host names allowed to serve images and videos; empty: any host.
    allowed_domains: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ConfigError(f"server.remote_images.max_bytes must be >= 1, got {self.max_bytes}")
        if self.timeout <= 0:
            raise ConfigError(f"server.remote_images.timeout must be > 0, got {self.timeout}")


# Memory a request's images take while it is processed, per pixel: decoded (4 bytes, as PIL
# holds RGB), as arrays for the image processor (3), and its working copies (about 1); the
# image being preprocessed takes as much again. Measured on 6000x6000 PNG, JPEG, RGBA and
# grayscale images: 14 bytes per pixel for one image, 7.9 for eight.
BYTES_PER_PIXEL = 8


def image_memory_bytes(num_pixels: int, largest_pixels: int) -> int:
    """Estimated memory for processing images of ``num_pixels`` in all, the largest of
    ``largest_pixels``."""
    return BYTES_PER_PIXEL * (num_pixels + largest_pixels)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer key required on /v1/*; empty: no key.
    api_key: str = ""
    # Bearer token that opens /admin/* to non-loopback clients; empty: loopback only.
    admin_token: str = ""
    # Largest accepted request body (base64 images count here).
    max_body_mb: int = 64
    # Images and videos in one request.
    max_images_per_request: int = 8
    # Frames kept from one video (models that take videos): sampled at the model's video
    # frame rate (Qwen2-VL: 2 a second), at most this many; frames sent as such, at most this many.
    max_video_frames: int = 32
    # Images with more pixels, and requests whose images have more pixels in all, are
    # refused before anything is decoded.
    max_image_pixels: int = 40_000_000
    max_request_pixels: int = 100_000_000
    # Memory for requests at once: their bodies (from reading to the end of processing),
    # and their decoded images (estimated from the headers); a request that does not fit
    # waits up to queue_timeout seconds, then gets 503 with Retry-After.
    max_inflight_body_mb: int = 256
    max_inflight_image_mb: int = 2048
    queue_timeout: float = 30.0
    # Requests the Request Processor (chat template, tokenizer, images) works on at
    # once; one more thread takes small requests only, so they never wait behind large ones.
    processor_threads: int = 2
    # Pixels of recently sent images the Request Processor keeps preprocessed, by their
    # file, in MiB: an image sent again (a chat's next turn, another question about it)
    # is neither decoded nor processed again. 0: none kept.
    processed_image_cache_mb: int = 512
    # Responses of /v1/responses kept for previous_response_id and GET /v1/responses/{id},
    # in MiB of the daemon's memory (least recently used out first; a restart keeps none).
    # 0: none kept (store true and previous_response_id are refused).
    responses_store_mb: int = 64
    router_policy: str = "round-robin"
    # HTTP processes serving the port (SO_REUSEPORT): the daemon and frontend_processes - 1
    # more, each parsing, preparing and streaming its own requests (the daemon alone holds
    # the workers and routes). More than 1 when one process cannot keep up with the tokens.
    frontend_processes: int = 1
    # On SIGTERM/SIGINT: seconds granted to in-flight requests before they are aborted.
    shutdown_timeout: float = 30.0
    # Seconds to wait for every worker to load weights and allocate caches.
    worker_start_timeout: float = 600.0
    # A worker that dies is restarted with its role; after this many restarts of one worker
    # within worker_restart_window seconds it is a crash loop and is not restarted again.
    # 0: never restart (a worker that dies stays down).
    worker_restart_limit: int = 3
    worker_restart_window: float = 300.0
    # A worker that holds requests and sends nothing for this many seconds, then answers
    # nothing to a probe for as long again, is killed and restarted (hung: a deadlock, a
    # stuck device); 0: never.
    worker_stall_timeout: float = 60.0
    # Requests held by a worker that dies run again elsewhere (or on the restarted worker)
    # from the tokens they had; their preprocessed images are kept for that up to this
    # many MiB in all (0: streaming requests with images then fail with their worker).
    rerun_image_mb: int = 1024
    # A request that is run again and loses that worker too fails, and the same request
    # (prompt tokens and images) is refused with a 400 for this many seconds: a client
    # resending a request that takes workers down would put them in a crash loop (0: never).
    quarantine_seconds: float = 300.0
    log_level: str = "info"
    # One line per finished request at info level (its id, sizes, latencies, stages).
    log_requests: bool = True
    remote_images: RemoteImageConfig = field(default_factory=RemoteImageConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port must be in [0, 65535], got {self.port}")
        for name in ("max_body_mb", "max_images_per_request", "max_video_frames", "max_image_pixels",
                     "max_request_pixels",
                     "max_inflight_body_mb", "max_inflight_image_mb", "processor_threads", "frontend_processes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"server.{name} must be >= 1, got {getattr(self, name)}")
        # Limits that would refuse every request they are meant to bound.
        if self.max_request_pixels < self.max_image_pixels:
            raise ConfigError(f"server.max_request_pixels ({self.max_request_pixels}) must be at least "
                              f"server.max_image_pixels ({self.max_image_pixels})")
        if self.max_inflight_body_mb < self.max_body_mb:
            raise ConfigError(f"server.max_inflight_body_mb ({self.max_inflight_body_mb}) must be at least "
                              f"server.max_body_mb ({self.max_body_mb})")
        largest = image_memory_bytes(self.max_request_pixels, self.max_image_pixels) >> 20
        if self.max_inflight_image_mb < largest:
            raise ConfigError(f"server.max_inflight_image_mb ({self.max_inflight_image_mb}) cannot hold one request "
                              f"of server.max_request_pixels: it needs {largest} MiB")
        for name in ("processed_image_cache_mb", "responses_store_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"server.{name} must be >= 0, got {getattr(self, name)}")
        if self.queue_timeout < 0:
            raise ConfigError(f"server.queue_timeout must be >= 0, got {self.queue_timeout}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ConfigError(
                f"server.router_policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.router_policy!r}"
            )
        if self.worker_restart_limit < 0 or self.worker_restart_window <= 0:
            raise ConfigError("server.worker_restart_limit must be >= 0 and server.worker_restart_window > 0")
        if self.worker_stall_timeout < 0:
            raise ConfigError(f"server.worker_stall_timeout must be >= 0, got {self.worker_stall_timeout}")
        if self.rerun_image_mb < 0:
            raise ConfigError(f"server.rerun_image_mb must be >= 0, got {self.rerun_image_mb}")
        if self.quarantine_seconds < 0:
            raise ConfigError(f"server.quarantine_seconds must be >= 0, got {self.quarantine_seconds}")
        if self.shutdown_timeout < 0 or self.worker_start_timeout <= 0:
            raise ConfigError("server.shutdown_timeout must be >= 0 and server.worker_start_timeout > 0")
        if self.log_level not in _LOG_LEVELS:
            raise ConfigError(f"server.log_level must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")


@dataclass(frozen=True)
class TraceConfig:
    # Append every finished request to a JSONL trace (its shape and latencies, never
    # its content): what `hydractl profile` and `--deploy auto` plan from.
    enabled: bool = True
    # Folder of the trace files; empty: $HYDRAD_STATE_DIR/trace (default
    # ~/.local/state/hydrad/trace).
    dir: str = ""
    # A file is rotated when it would grow past this size; this many files are kept.
    max_file_mb: int = 64
    max_files: int = 4

    def __post_init__(self) -> None:
        if self.max_file_mb < 1 or self.max_files < 1:
            raise ConfigError("trace.max_file_mb and trace.max_files must be >= 1")

    @property
    def directory(self) -> Path:
        from hydrad.trace import default_trace_dir

        return Path(self.dir).expanduser() if self.dir else default_trace_dir()


@dataclass(frozen=True)
class PlannerConfig:
    # Re-plan while serving: every `interval` seconds, rank the deployments of these devices
    # on the requests of the last `window` seconds of the trace, and redeploy when the best
    # one's simulated goodput beats the running one's by `margin` (0.25: by 25%), at most
    # once per `min_interval` seconds. Needs the trace ([trace] enabled).
    auto: bool = False
    interval: float = 300.0
    window: float = 1800.0
    # Fewer finished requests in the window say too little about the workload: no decision.
    min_requests: int = 50
    margin: float = 0.25
    min_interval: float = 1800.0
    # Requests each simulated replay takes from the window (more: slower and steadier).
    num_requests: int = 300
    # `--deploy auto` keeps each plan it makes (and, with `auto`, each deployment it
    # redeploys to); a start reuses it for the same model, devices, engine settings and
    # trace while it is younger than this, unless the trace has gained as many requests as
    # it was made from. 0: plan at every start.
    reuse_hours: float = 24.0

    def __post_init__(self) -> None:
        for name in ("interval", "window", "min_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"planner.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.min_requests < 1 or self.num_requests < 10:
            raise ConfigError("planner.min_requests must be >= 1 and planner.num_requests >= 10")
        if self.margin < 0:
            raise ConfigError(f"planner.margin must be >= 0, got {self.margin}")
        if self.reuse_hours < 0:
            raise ConfigError(f"planner.reuse_hours must be >= 0, got {self.reuse_hours}")


@dataclass(frozen=True)
class DaemonConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        if self.planner.auto and not self.trace.enabled:
            raise ConfigError("planner.auto re-plans from the request trace: it needs [trace] enabled = true")


_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "slo": SLOConfig,
    "trace": TraceConfig,
    "planner": PlannerConfig,
}


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> DaemonConfig:
    """Read ``path`` (None: defaults only), apply dotted-key ``overrides``, validate."""
    raw: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    for key, value in (overrides or {}).items():
        *parents, leaf = key.split(".")
        table = raw
        for p in parents:
            table = table.setdefault(p, {})
        table[leaf] = value
    try:
        return _build(raw)
    except ConfigError as e:
        if any(re.search(rf"\b{re.escape(key)}\b", str(e)) for key in overrides or {}):
            # A value given on the command line, not the file's.
            raise ConfigError(f"{e} (given on the command line)") from None
        raise ConfigError(f"{where}: {e}") from None


def _build(raw: dict[str, Any]) -> DaemonConfig:
    unknown = set(raw) - set(_SECTIONS) - {"seed"}
    if unknown:
        raise ConfigError(f"unknown section or key {sorted(unknown)[0]!r}")
    parts = {name: _make(cls, raw.get(name, {}), name) for name, cls in _SECTIONS.items()}
    server = parts.pop("server")
    trace = parts.pop("trace")
    planner = parts.pop("planner")
    seed = raw.get("seed", 0)
    _check_type(seed, int, "seed")
    return DaemonConfig(engine=EngineConfig(**parts, seed=seed), server=server, trace=trace, planner=planner)


def _make(cls: type, table: Any, prefix: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"[{prefix}] must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    retired = [k for k in table if k not in names and f"{prefix}.{k}" in _RETIRED]
    for key in retired:
        logger.warning("%s.%s is ignored: %s", prefix, key, _RETIRED[f"{prefix}.{key}"])
    if retired:
        table = {k: v for k, v in table.items() if k not in retired}
    unknown = set(table) - names
    if unknown:
        raise ConfigError(f"unknown key {prefix}.{sorted(unknown)[0]}")
    kwargs = {}
    for key, value in table.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _make(hint, value, f"{prefix}.{key}")
        else:
            _check_type(value, hint, f"{prefix}.{key}")
            kwargs[key] = float(value) if hint is float else value
    return cls(**kwargs)


def _check_type(value: Any, hint: Any, name: str) -> None:
    if _matches(value, hint):
        return
    expected = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
    raise ConfigError(f"{name} must be {expected}, got {value!r}")


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
