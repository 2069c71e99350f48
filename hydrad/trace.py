"""The request trace: every finished request as one JSON line, and reading traces back.

The daemon hands each finished completion to a ``TraceWriter``, which appends one line
to ``trace.jsonl`` under its directory and rotates the file when it grows past its size
limit (``trace.1.jsonl`` is the newest rotated file; the oldest beyond ``max_files``
goes). A line holds the request's shape and what it experienced, never its content: no
prompt text and no image data. The format is documented in ``docs/planner.md``; the
planner replays traces (``hydrad.planner.workload``) and ``hydractl bench --workload``
accepts them.

This module imports nothing heavy: the daemon, the bench client and the planner share it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hydrad.errors import ConfigError
from hydrad.paths import state_dir

logger = logging.getLogger("hydrad.trace")

FORMAT = "hydrad-trace/1"
# One encoder for every line (``json.dumps`` with options builds a new one per call).
_encode = json.JSONEncoder(separators=(",", ":")).encode
CURRENT = "trace.jsonl"
# Finish reasons of requests that ran to their end: the ones a replay reproduces.
COMPLETED = ("stop", "length")
# A traced video is replayed as its kept frames at 2 a second, the rate Qwen2-VL's video
# processor samples at: the server keeps them all again.
REPLAY_VIDEO_FPS = 2


def default_trace_dir() -> Path:
    return state_dir() / "trace"


@dataclass(frozen=True)
class TraceImage:
    width: int | None  # the image as sent (None when the server did not see its size)
    height: int | None
    tokens: int  # image tokens in the prompt
    offset: int  # position of its first token in the prompt
    # Patch positions the vision tower ran over (what encoding it cost; 0: unknown).
    patches: int = 0
    # The patches one attention of the tower spanned (``ImageInput.attention_span``; 0: all).
    span: int = 0
    frames: int = 0  # a video's frames as the server kept them; 0: an image


@dataclass(frozen=True)
class TraceRecord:
    """One finished request (times in seconds)."""

    timestamp: float  # UNIX time the daemon read the request
    model: str
    prompt_tokens: int  # as the engine saw the prompt: chat template and image tokens included
    # Prompt tokens outside images, and how many of those the chat template adds on its own.
    text_tokens: int
    template_tokens: int
    images: tuple[TraceImage, ...]
    output_tokens: int
    max_tokens: int
    finish_reason: str
    preprocess: float  # reading the request -> handed to an instance (template, tokenizer, images)
    ttft: float | None
    e2e: float
    # The request's own inter-token gaps: their count, p50, p90 and maximum.
    num_gaps: int
    tbt_p50: float | None
    tbt_p90: float | None
    tbt_max: float | None
    # Seconds per stage: encode_queue, encode_exec, encode_to_prefill_migration,
    # prefill_queue, prefill_exec, prefill_to_decode_migration, decode_queue, decode_exec.
    stages: dict[str, float]
    instances: tuple[int, ...]  # entry instance, then each migration's target
    deploy: str
    # Prompt tokens found in a prefix cache where its prefill started (their prefill skipped).
    cached_tokens: int = 0
    # Of ``preprocess``, the CPU seconds the Request Processor's thread spent on the request
    # (chat template, tokenizer, images), without the waits for a thread, for memory or for the
    # interpreter lock: what the planner replays as its service time. None in traces written
    # before it was recorded.
    processing: float | None = None
    # It asked for its prompt's log-probabilities (a scoring request: ``echo`` with ``logprobs``,
    # ``prompt_logprobs``), which its prefill computes at every prompt position.
    prompt_logprobs: bool = False
    # One of the ``n`` completions of a prompt: a digest of the prompt's group
    # (``EngineRequest.group``), the same on each of them; None for a prompt's only completion.
    group: str | None = None
    # Of its images, those the Request Processor found preprocessed (a file sent before):
    # their ``processing`` had neither decoding nor the image processor.
    images_found: int = 0

    @property
    def completed(self) -> bool:
        return self.finish_reason in COMPLETED

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "timestamp": round(self.timestamp, 6), "model": self.model,
            "prompt_tokens": self.prompt_tokens, "text_tokens": self.text_tokens,
            "template_tokens": self.template_tokens,
            "images": [{"width": i.width, "height": i.height, "tokens": i.tokens, "offset": i.offset,
                        "patches": i.patches, "span": i.span, "frames": i.frames} for i in self.images],
            "output_tokens": self.output_tokens, "max_tokens": self.max_tokens, "finish_reason": self.finish_reason,
            "preprocess": _round(self.preprocess), "ttft": _round(self.ttft), "e2e": _round(self.e2e),
            "tbt": {"count": self.num_gaps, "p50": _round(self.tbt_p50), "p90": _round(self.tbt_p90),
                    "max": _round(self.tbt_max)},
            "stages": {k: _round(v) for k, v in sorted(self.stages.items())},
            "instances": list(self.instances), "deploy": self.deploy, "cached_tokens": self.cached_tokens,
            **({"processing": _round(self.processing)} if self.processing is not None else {}),
            **({"prompt_logprobs": True} if self.prompt_logprobs else {}),
            **({"group": self.group} if self.group is not None else {}),
            **({"images_found": self.images_found} if self.images_found else {}),
        }

    @classmethod
    def from_json(cls, obj: dict) -> TraceRecord:
        """Raises KeyError, TypeError or ValueError on a malformed line."""
        if obj.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} line")
        tbt = obj.get("tbt") or {}
        images = tuple(TraceImage(i.get("width"), i.get("height"), int(i["tokens"]), int(i["offset"]),
                                  int(i.get("patches", 0)), int(i.get("span", 0)), int(i.get("frames", 0)))
                       for i in obj["images"])
        record = cls(
            timestamp=float(obj["timestamp"]), model=str(obj["model"]), prompt_tokens=int(obj["prompt_tokens"]),
            text_tokens=int(obj["text_tokens"]), template_tokens=int(obj.get("template_tokens", 0)), images=images,
            output_tokens=int(obj["output_tokens"]), max_tokens=int(obj.get("max_tokens", obj["output_tokens"])),
            finish_reason=str(obj["finish_reason"]), preprocess=float(obj.get("preprocess") or 0.0),
            ttft=_float(obj.get("ttft")), e2e=float(obj.get("e2e") or 0.0), num_gaps=int(tbt.get("count", 0)),
            tbt_p50=_float(tbt.get("p50")), tbt_p90=_float(tbt.get("p90")), tbt_max=_float(tbt.get("max")),
            stages={str(k): float(v) for k, v in (obj.get("stages") or {}).items()},
            instances=tuple(int(i) for i in obj.get("instances", ())), deploy=str(obj.get("deploy", "")),
            cached_tokens=int(obj.get("cached_tokens", 0)), processing=_float(obj.get("processing")),
            prompt_logprobs=bool(obj.get("prompt_logprobs", False)),
            group=None if obj.get("group") is None else str(obj["group"]),
            images_found=int(obj.get("images_found", 0)),
        )
        if (record.prompt_tokens < 1 or record.output_tokens < 0 or any(i.tokens < 1 for i in images)
                or not 0 <= record.cached_tokens < record.prompt_tokens
                or not 0 <= record.images_found <= len(images)):
            raise ValueError("token counts out of range")
        return record

    def bench_entry(self) -> dict:
        """The request as a line of a ``hydractl bench`` JSONL workload: a generated prompt of
        the user's text tokens (the chat template adds its own again), the images' sizes, the
        videos' frames and size (at ``REPLAY_VIDEO_FPS``), the output length, the arrival time,
        and whether it asked for its prompt's log-probabilities (sent again as such)."""
        entry = {
            "prompt_tokens": max(1, self.text_tokens - self.template_tokens),
            "images": [{"width": i.width or 336, "height": i.height or 336} for i in self.images if not i.frames],
            "output_tokens": max(1, self.output_tokens),
            "timestamp": self.timestamp,
        }
        videos = [{"frames": i.frames, "width": i.width or 336, "height": i.height or 336, "fps": REPLAY_VIDEO_FPS}
                  for i in self.images if i.frames]
        if videos:
            entry["videos"] = videos
        if self.prompt_logprobs:
            entry["prompt_logprobs"] = True
        return entry


def _round(value: float | None) -> float | None:
    # To the microsecond; round() without digits is several times cheaper than round(x, 6),
    # and the same on a value already rounded (records read back write the same line).
    return None if value is None else round(value * 1e6) / 1e6


def _float(value) -> float | None:
    return None if value is None else float(value)


def _percentile(ordered: list[float], q: float) -> float:
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def make_record(*, timestamp: float, model: str, prompt_tokens: int, template_tokens: int,
                images: list[tuple[int | None, int | None, int, int, int, int, int]], output_tokens: int,
                max_tokens: int, finish_reason: str, preprocess: float, ttft: float | None, e2e: float,
                gaps: list[float] | None, stages: dict[str, float] | None, instances: list[int], deploy: str,
                cached_tokens: int = 0, processing: float | None = None, prompt_logprobs: bool = False,
                group: str | None = None, images_found: int = 0) -> TraceRecord:
    """A record from what the daemon knows when a completion ends; ``images`` holds
    (width, height, tokens, offset[, patches[, span[, frames]]]) per image (``TraceImage``);
    ``group``: the completion's ``EngineRequest.group`` (recorded as a digest of it)."""
    ordered = sorted(gaps or ())
    stats = (_percentile(ordered, 50), _percentile(ordered, 90), ordered[-1]) if ordered else (None, None, None)
    image_tokens = sum(image[2] for image in images)
    return TraceRecord(
        timestamp=timestamp, model=model, prompt_tokens=prompt_tokens, text_tokens=prompt_tokens - image_tokens,
        template_tokens=template_tokens, images=tuple(TraceImage(*i) for i in images), output_tokens=output_tokens,
        max_tokens=max_tokens, finish_reason=finish_reason, preprocess=max(0.0, preprocess), ttft=ttft, e2e=e2e,
        num_gaps=len(ordered), tbt_p50=stats[0], tbt_p90=stats[1], tbt_max=stats[2], stages=dict(stages or {}),
        instances=tuple(instances), deploy=deploy, cached_tokens=cached_tokens,
        processing=None if processing is None else max(0.0, processing), prompt_logprobs=prompt_logprobs,
        group=None if group is None else hashlib.blake2b(group.encode(), digest_size=8).hexdigest(),
        images_found=images_found,
    )


def count_template_tokens(processor) -> int:
    """How many prompt tokens the chat template adds around a user's text (0 if unknown):
    the tokens of a one-word chat request minus the word's own."""
    try:
        word = "the"
        chat = len(processor.process_chat([{"role": "user", "content": word}]).prompt_token_ids)
        alone = len(processor.tokenizer.encode(word, add_special_tokens=False))
        return max(0, chat - alone)
    except Exception as e:  # a processor without a chat template: replays keep the whole text
        logger.debug("could not count the chat template's tokens: %s", e)
        return 0


class TraceWriter:
    """Appends records to ``directory/trace.jsonl``; rotates past ``max_bytes`` per file,
    keeping ``max_files`` files in all. Called on the daemon's event loop: one buffered
    write and a flush per request."""

    def __init__(self, directory: str | Path, *, max_bytes: int, max_files: int, model: str,
                 deploy: str | Callable[[], str], template_tokens: int = 0):
        """``deploy``: the deployment serving, or a function that names the one serving now
        (it changes on a redeploy)."""
        if max_bytes < 1 or max_files < 1:
            raise ValueError("a trace needs max_bytes >= 1 and max_files >= 1")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.model = model
        self._deploy = deploy if callable(deploy) else (lambda: deploy)
        self.template_tokens = template_tokens
        self.num_records = 0
        self._lock = threading.Lock()  # the admin route reads from a thread
        self._file = None
        self._size = 0
        self._failed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._open()
        except OSError as e:
            raise ConfigError(f"cannot write the request trace in {self.directory}: {e.strerror or e}") from None

    @property
    def path(self) -> Path:
        return self.directory / CURRENT

    def record(self, **facts) -> None:
        """``make_record``'s arguments, less the model, deployment and template tokens."""
        self.write(make_record(model=self.model, deploy=self._deploy(), template_tokens=self.template_tokens,
                               **facts))

    def write(self, record: TraceRecord) -> None:
        line = _encode(record.to_json()) + "\n"
        with self._lock:
            try:
                if self._file is None:  # a write or a rotation failed: try again
                    self._open()
                if self._size and self._size + len(line) > self.max_bytes:
                    self._rotate()
                self._file.write(line)
                self._file.flush()
                self._size += len(line)
                self.num_records += 1
            except OSError as e:
                # A full disk must not fail requests: say it once, keep serving. What was
                # written of the line (if anything) ends at the next open (``_open``).
                self._close_file()
                if not self._failed:
                    logger.error("request trace %s: %s; records are dropped until it is writable", self.path, e)
                    self._failed = True
                return
            if self._failed:
                logger.warning("request trace %s: writable again", self.path)
                self._failed = False

    def _open(self) -> None:
        """Open the current file to append. A line left unfinished (the process killed in a
        write, a full disk) is ended first, so that the next record starts a line."""
        path = self.directory / CURRENT
        f = open(path, "a", encoding="utf-8")
        try:
            size = f.tell()
            if size:
                with open(path, "rb") as tail:
                    tail.seek(size - 1)
                    if tail.read(1) != b"\n":
                        f.write("\n")
                        f.flush()
                        size += 1
        except OSError:
            _close_quietly(f)
            raise
        self._file, self._size = f, size

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            _close_quietly(f)

    def _rotate(self) -> None:
        self._close_file()
        oldest = self.directory / f"trace.{self.max_files - 1}.jsonl"
        if self.max_files == 1:
            (self.directory / CURRENT).unlink(missing_ok=True)
        else:
            oldest.unlink(missing_ok=True)
            for i in range(self.max_files - 2, 0, -1):
                src = self.directory / f"trace.{i}.jsonl"
                if src.exists():
                    src.rename(self.directory / f"trace.{i + 1}.jsonl")
            (self.directory / CURRENT).rename(self.directory / "trace.1.jsonl")
        self._open()

    def recent(self, limit: int) -> list[str]:
        """The newest ``limit`` lines, oldest first."""
        with self._lock:
            lines: list[str] = []
            for path in reversed(trace_files(self.directory)):
                lines[:0] = path.read_text(encoding="utf-8").splitlines()
                if len(lines) >= limit:
                    break
            return lines[-limit:] if limit else []

    def close(self) -> None:
        with self._lock:
            self._close_file()


def _close_quietly(f) -> None:
    try:
        f.close()
    except OSError:  # what its buffer held could not be written either: dropped
        pass


def trace_files(directory: str | Path) -> list[Path]:
    """A trace directory's files, oldest first (the rotated ones, then the current one)."""
    directory = Path(directory)
    rotated = []
    for path in directory.glob("trace.*.jsonl"):
        index = path.name[len("trace."):-len(".jsonl")]
        if index.isdigit():
            rotated.append((int(index), path))
    files = [p for _, p in sorted(rotated, reverse=True)]
    if (directory / CURRENT).is_file():
        files.append(directory / CURRENT)
    return files


# The bad lines already reported, (file, line number): a trace is read again and again (the
# replanning monitor), and each is said once.
_reported: set[tuple[str, int]] = set()


def parse_lines(lines: list[str], where: str, *, ended: bool = True) -> list[TraceRecord]:
    """The records of a trace's lines. A line that is not a record (a write cut short by a
    kill or a full disk, a line edited by hand) is skipped with a warning, once; the last
    line of text that did not end with a newline (``ended`` False: a write in progress, or
    cut short) is skipped silently. Lines none of which is a record are not a trace: an error."""
    records = []
    bad: list[tuple[int, Exception]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(TraceRecord.from_json(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            bad.append((lineno, e))
    if bad and not ended and bad[-1][0] == len(lines):
        bad.pop()
    if bad and not records:
        lineno, e = bad[0]
        raise ConfigError(f"{where}:{lineno}: not a {FORMAT} record ({e})")
    if bad and (where, bad[0][0]) not in _reported:
        _reported.add((where, bad[0][0]))
        lineno, e = bad[0]
        logger.warning("%s: skipped %d line(s) that are not %s records (line %d: %s)", where, len(bad), FORMAT,
                       lineno, e)
    return records


def read_trace(path: str | Path, *, model: str | None = None, completed_only: bool = True,
               newest: int | None = None, since: float | None = None) -> list[TraceRecord]:
    """Records of a trace file or directory, sorted by arrival; only those of ``model`` (a
    model name) when given, and only requests that ran to their end unless told otherwise;
    ``newest``: only the last that many; ``since``: only those that arrived then (UNIX time)
    or later. With either, the directory's files are read newest first, and no further than
    they need (a full trace is four files of 64 MiB)."""
    path = Path(path)
    if path.is_dir():
        files = trace_files(path)
        if not files:
            raise ConfigError(f"no trace files ({CURRENT}, trace.N.jsonl) in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"trace not found: {path}")
    records: list[TraceRecord] = []
    for file in reversed(files):
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ConfigError(f"cannot read trace {file}: {e.strerror or e}") from None
        parsed = parse_lines(text.splitlines(), str(file), ended=text.endswith("\n"))
        records += [r for r in parsed if (model is None or r.model == model) and (r.completed or not completed_only)
                    and (since is None or r.timestamp >= since)]
        if newest is not None and len(records) >= newest:
            break
        if since is not None and parsed and min(r.timestamp + r.e2e for r in parsed) < since:
            # A request is written as it ends (its arrival plus e2e): this file began before
            # ``since``, so every request in the older ones ended, and arrived, before it.
            break
    records.sort(key=lambda r: r.timestamp)
    return records if newest is None else records[-newest:] if newest > 0 else []


def wall_clock(monotonic_time: float) -> float:
    """The UNIX time of a ``time.monotonic()`` instant in the recent past."""
    return time.time() - (time.monotonic() - monotonic_time)
