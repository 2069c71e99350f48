"""Workloads: what each benchmark request asks for (prompt, images, output length).

A workload is a deterministic function of ``(seed, salt, index)``. The runner gives
each run of a sweep or goodput search its own salt, so every rate sees fresh prompts
and images with the same distribution, and no server-side prefix or image cache
carries over from one rate to the next.

Prompts of a given token count are sequences of common English words drawn from
``WORDS``; each is a single token with a leading space in the Llama, Qwen and GPT
BPE vocabularies, so the count is close to exact for those tokenizers and
approximate for others.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hydrad.bench.arrivals import Trace
from hydrad.errors import ConfigError

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by but not what all were we when your can said there use an each which she do "
    "how their if will up other about out many then them these so some her would make like him "
    "into time has look two more write go see number no way could people my than first water "
    "been call who its now find long down day did get come made may part"
).split()

# Mooncake hashes prompts in blocks of this many tokens; equal hash ids mean a shared prefix.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class SynthImage:
    width: int
    height: int
    seed: int


@dataclass(frozen=True)
class SynthVideo:
    frames: int
    width: int
    height: int
    fps: float
    seed: int


@dataclass(frozen=True)
class RequestSpec:
    """One request's content. ``images`` holds synthetic images or image file paths,
    ``videos`` synthetic videos or video file paths."""

    prompt: str
    output_tokens: int
    images: tuple[SynthImage | str, ...] = ()
    videos: tuple[SynthVideo | str, ...] = ()
    # Its prompt's log-probabilities asked for (a scoring request: vLLM's ``prompt_logprobs``).
    prompt_logprobs: bool = False
    # Completions of the prompt asked for (the API's ``n``); more than one come in a whole answer.
    n: int = 1


class Workload(Protocol):
    # Arrival times in seconds carried by the workload itself (a JSONL file), else None.
    timestamps: tuple[float, ...] | None

    def request(self, index: int, salt: int | str) -> RequestSpec: ...


def make_prompt(num_tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=num_tokens))


def _rng(*key: object) -> random.Random:
    # Seeding from a string hashes it with SHA-512: stable across processes and versions.
    return random.Random("/".join(map(str, key)))


@dataclass(frozen=True)
class Profile:
    """A dataset-like request distribution; ranges are inclusive and sampled uniformly."""

    name: str
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    # (width, height) choices; one is drawn per request. Empty: a text-only request.
    image_sizes: tuple[tuple[int, int], ...]

    def sample(self, rng: random.Random) -> RequestSpec:
        prompt = make_prompt(rng.randint(*self.prompt_tokens), rng)
        output_tokens = rng.randint(*self.output_tokens)
        if not self.image_sizes:
            return RequestSpec(prompt, output_tokens)
        width, height = rng.choice(self.image_sizes)
        return RequestSpec(prompt, output_tokens, (SynthImage(width, height, rng.getrandbits(63)),))


# The five datasets of the HydraInfer evaluation, one image per request. Sources: the
# task definitions and the image statistics of each dataset as summarised in
# ../shared/workloads/README.md; figures marked "est." are estimates, not measurements.
PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        # TextCaps: the fixed instruction "Provide a one-sentence caption for the provided
        # image." is ~11 tokens; reference captions are 10-30 tokens; OpenImages photos
        # resized to a long side of at most 1024 px.
        Profile("textcaps", (11, 11), (10, 30), ((1024, 768), (768, 1024), (1024, 683), (1024, 576), (1024, 1024))),
        # POPE: "Is there a <object> in the image?" (~10 tokens), answered yes/no in 1-15
        # tokens; COCO val2014 images, mostly 640x480.
        Profile("pope", (9, 12), (1, 15), ((640, 480), (480, 640), (640, 427))),
        # MME: a question plus " Please answer yes or no." (~15-40 tokens), 1-3 output
        # tokens; images of mixed size, ~300 px to over 1000 px.
        Profile("mme", (15, 40), (1, 3), ((336, 336), (512, 384), (640, 480), (800, 600), (1024, 768), (1280, 960))),
        # TextVQA: ~7-word questions (~10-14 tokens), 1-5 token answers; OpenImages, <= 1024 px.
        Profile("textvqa", (10, 14), (1, 5), ((1024, 768), (768, 1024), (1024, 683))),
        # VizWiz: short spoken questions from blind users (est. 6-20 tokens), short answers
        # (est. 1-10 tokens); phone photos, ~1296x968 in either orientation.
        Profile("vizwiz", (6, 20), (1, 10), ((1296, 968), (968, 1296))),
        # A generic text chat request (not from a dataset): a paragraph in, a paragraph out.
        Profile("text", (32, 256), (16, 128), ()),
    )
}


class MixWorkload:
    """Each request drawn from one profile, picked with the given relative weights."""

    timestamps = None

    def __init__(self, profiles: list[Profile], weights: list[float], seed: int):
        self.profiles = profiles
        self.weights = weights
        self.seed = seed

    def request(self, index: int, salt: int | str) -> RequestSpec:
        rng = _rng(self.seed, salt, index)
        profile = rng.choices(self.profiles, weights=self.weights)[0] if len(self.profiles) > 1 else self.profiles[0]
        return profile.sample(rng)


class ChatWorkload:
    """Conversations of ``turns`` turns about one image each (a profile's image, questions and
    answer lengths): turn t asks the conversation so far — its image, the earlier questions
    and the answers (synthetic text of the answer lengths, as if the model had given them) —
    and one more question, so each turn's prompt begins with the one before it (what prefix
    caching keeps). Conversations run ``window`` at a time, interleaved: a conversation's
    next turn comes ``window`` requests after its last, answered by then as a user's would be
    (keep it at least the number of requests in flight). ``chat:PROFILE:TURNS[:WINDOW]``."""

    timestamps = None

    def __init__(self, profile: Profile, turns: int, window: int = 32, *, seed: int):
        if turns < 1 or window < 1:
            raise ConfigError(f"a chat workload needs turns and a window >= 1, got {turns} and {window}")
        self.profile = profile
        self.turns = turns
        self.window = window
        self.seed = seed

    def position(self, index: int) -> tuple[int, int]:
        """(conversation, turn) of request ``index``."""
        block, within = divmod(index, self.window * self.turns)
        turn, slot = divmod(within, self.window)
        return block * self.window + slot, turn

    def request(self, index: int, salt: int | str) -> RequestSpec:
        conversation, turn = self.position(index)
        rng = _rng(self.seed, salt, "chat", conversation)
        p = self.profile
        images = ()
        if p.image_sizes:
            width, height = rng.choice(p.image_sizes)
            images = (SynthImage(width, height, rng.getrandbits(63)),)
        parts = []
        for t in range(turn + 1):
            parts.append(make_prompt(rng.randint(*p.prompt_tokens), rng))
            output_tokens = rng.randint(*p.output_tokens)
            if t < turn:
                parts.append(make_prompt(output_tokens, rng))
        return RequestSpec(" ".join(parts), output_tokens, images)


class TraceTextWorkload:
    """Text requests with a trace's lengths; equal Mooncake hash ids give equal prompt prefixes."""

    timestamps = None

    def __init__(self, trace: Trace, seed: int):
        self.trace = trace
        self.seed = seed

    def request(self, index: int, salt: int | str) -> RequestSpec:
        i = index % len(self.trace)
        num_tokens = self.trace.input_lengths[i]
        hash_ids = self.trace.hash_ids[i] if self.trace.hash_ids else ()
        blocks = [make_prompt(MOONCAKE_BLOCK_TOKENS, _rng(self.seed, salt, "block", h)) for h in hash_ids]
        words = " ".join(blocks).split()
        if len(words) < num_tokens:
            words += make_prompt(num_tokens - len(words), _rng(self.seed, salt, index)).split()
        return RequestSpec(" ".join(words[:num_tokens]), max(1, self.trace.output_lengths[i]))


@dataclass(frozen=True)
class _FileEntry:
    prompt: str | None
    prompt_tokens: int | None
    images: tuple[tuple[int, int] | str, ...]
    output_tokens: int
    videos: tuple[tuple[int, int, int, float] | str, ...] = ()  # (frames, width, height, fps) or a path
    prompt_logprobs: bool = False
    n: int = 1


class FileWorkload:
    """Requests read from a JSONL file, one per line, cycled when more are needed."""

    def __init__(self, entries: list[_FileEntry], timestamps: tuple[float, ...] | None, seed: int):
        self.entries = entries
        self.timestamps = timestamps
        self.seed = seed

    def request(self, index: int, salt: int | str) -> RequestSpec:
        entry = self.entries[index % len(self.entries)]
        rng = _rng(self.seed, salt, index)
        prompt = entry.prompt if entry.prompt is not None else make_prompt(entry.prompt_tokens, rng)
        images = tuple(
            img if isinstance(img, str) else SynthImage(img[0], img[1], rng.getrandbits(63)) for img in entry.images
        )
        videos = tuple(v if isinstance(v, str) else SynthVideo(*v, rng.getrandbits(63)) for v in entry.videos)
        return RequestSpec(prompt, entry.output_tokens, images, videos, entry.prompt_logprobs, entry.n)


def _positive_int(value: object, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {what} must be a positive integer, got {value!r}")
    return value


def _media_list(obj: dict, key: str, where: str) -> list:
    items = obj.get(key, [])
    if not isinstance(items, list):
        raise ConfigError(f"{where}: '{key}' must be a list")
    return items


def _media_file(name: str, kind: str, where: str, base: Path) -> str:
    """An image or video file named in a workload line (relative to the file), which must exist."""
    path = Path(name) if Path(name).is_absolute() else base / name
    if not path.is_file():
        raise ConfigError(f"{where}: {kind} file {name!r} not found")
    return str(path)


def _parse_entry(obj: object, where: str, base: Path) -> tuple[_FileEntry, float | None]:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    prompt, prompt_tokens = obj.get("prompt"), obj.get("prompt_tokens")
    if (prompt is None) == (prompt_tokens is None):
        raise ConfigError(f"{where}: give exactly one of 'prompt' and 'prompt_tokens'")
    if prompt is not None and not isinstance(prompt, str):
        raise ConfigError(f"{where}: 'prompt' must be a string")
    if prompt_tokens is not None:
        prompt_tokens = _positive_int(prompt_tokens, "'prompt_tokens'", where)
    output_tokens = _positive_int(obj.get("output_tokens"), "'output_tokens'", where)
    images: list[tuple[int, int] | str] = []
    for img in _media_list(obj, "images", where):
        if isinstance(img, str):
            images.append(_media_file(img, "image", where, base))
        elif isinstance(img, dict):
            images.append((_positive_int(img.get("width"), "image width", where),
                           _positive_int(img.get("height"), "image height", where)))
        else:
            raise ConfigError(f"{where}: an image is a file path or {{\"width\": w, \"height\": h}}")
    videos: list[tuple[int, int, int, float] | str] = []
    for video in _media_list(obj, "videos", where):
        if isinstance(video, str):
            videos.append(_media_file(video, "video", where, base))
        elif isinstance(video, dict):
            fps = video.get("fps", 2)
            if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0:
                raise ConfigError(f"{where}: video fps must be a positive number, got {fps!r}")
            videos.append((_positive_int(video.get("frames"), "video frames", where),
                           _positive_int(video.get("width"), "video width", where),
                           _positive_int(video.get("height"), "video height", where), float(fps)))
        else:
            raise ConfigError(f"{where}: a video is a file path or {{\"frames\": n, \"width\": w, "
                              f"\"height\": h, \"fps\": f}}")
    timestamp = obj.get("timestamp")
    if timestamp is not None and (isinstance(timestamp, bool) or not isinstance(timestamp, (int, float))
                                  or timestamp < 0):
        raise ConfigError(f"{where}: 'timestamp' must be a number of seconds >= 0")
    prompt_logprobs = obj.get("prompt_logprobs", False)
    if not isinstance(prompt_logprobs, bool):
        raise ConfigError(f"{where}: 'prompt_logprobs' must be true or false, got {prompt_logprobs!r}")
    n = _positive_int(obj.get("n", 1), "'n'", where)
    return _FileEntry(prompt, prompt_tokens, tuple(images), output_tokens, tuple(videos), prompt_logprobs, n), timestamp


def _read_lines(path: Path) -> list[tuple[str, str]]:
    """(where, line) for every line of a workload file, or of a hydrad trace directory."""
    from hydrad.trace import trace_files

    files = trace_files(path) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"{path} holds no trace files")
    out = []
    for file in files:
        try:
            lines = file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read workload file {file}: {getattr(e, 'strerror', None) or e}") from None
        out += [(f"{file}:{lineno}", line) for lineno, line in enumerate(lines, 1)]
    return out


def _trace_entry(obj: dict, where: str) -> dict | None:
    """A line of a hydrad request trace as a workload line; None for a request that did not
    run to its end (aborted, failed), which a replay leaves out."""
    from hydrad.trace import TraceRecord

    try:
        record = TraceRecord.from_json(obj)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{where}: malformed request trace record ({e})") from None
    return record.bench_entry() if record.completed else None


def load_file_workload(path: str | Path, seed: int) -> FileWorkload:
    """A JSONL workload file, or a hydrad request trace (a file, or the daemon's trace
    directory): each traced request that ran to its end becomes one request, the ``n``
    completions of one (traced as one ``group``) one request with that ``n``, of their mean
    output length, sent when the first arrived."""
    from hydrad.trace import FORMAT

    path = Path(path)
    lines: list[tuple[str, dict]] = []
    groups: dict[str, tuple[dict, list[int]]] = {}  # a group's line, and its completions' lengths
    for where, line in _read_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: invalid JSON ({e.msg})") from None
        if isinstance(obj, dict) and obj.get("format") == FORMAT:
            group = obj.get("group")
            obj = _trace_entry(obj, where)
            if obj is None:
                continue
            if group is not None:
                if group in groups:
                    first, lengths = groups[group]
                    first["n"] = first.get("n", 1) + 1
                    first["timestamp"] = min(first["timestamp"], obj["timestamp"])
                    lengths.append(obj["output_tokens"])
                    continue
                groups[group] = (obj, [obj["output_tokens"]])
        lines.append((where, obj))
    for first, lengths in groups.values():
        first["output_tokens"] = max(1, round(sum(lengths) / len(lengths)))
    entries, timestamps = [], []
    for where, obj in lines:
        entry, timestamp = _parse_entry(obj, where, path.parent)
        entries.append(entry)
        timestamps.append(timestamp)
    if not entries:
        raise ConfigError(f"workload file {path} holds no requests")
    # Arrival times only when every line has one; a partial set has no meaning.
    if not all(t is not None for t in timestamps):
        return FileWorkload(entries, None, seed)
    # Request i is sent at the i-th arrival, so entries follow their timestamps' order.
    order = sorted(range(len(entries)), key=timestamps.__getitem__)
    return FileWorkload([entries[i] for i in order], tuple(timestamps[i] for i in order), seed)


def _parse_mix(spec: str) -> tuple[list[Profile], list[float]]:
    profiles, weights = [], []
    for part in spec.split(","):
        name, sep, weight = part.partition("=")
        name = name.strip()
        if name not in PROFILES:
            raise ConfigError(f"unknown profile {name!r} in {spec!r}; known: {', '.join(PROFILES)}")
        try:
            w = float(weight) if sep else float("nan")
        except ValueError:
            w = float("nan")
        if not w > 0:
            raise ConfigError(f"mixture weights are positive numbers: 'mix:{spec}'")
        profiles.append(PROFILES[name])
        weights.append(w)
    return profiles, weights


def load_workload(spec: str, seed: int, trace: Trace | None = None) -> Workload:
    """Resolve ``spec``: a profile name, ``mix:a=w,b=w``, ``chat:PROFILE:TURNS`` (multi-turn
    conversations, ``ChatWorkload``), or a path to a JSONL file or a hydrad request trace (file
    or directory).

    With the ``text`` profile and a trace that carries lengths (Mooncake), the requests
    take their prompt and output lengths from the trace.
    """
    if spec.startswith("mix:"):
        return MixWorkload(*_parse_mix(spec[len("mix:"):]), seed=seed)
    if spec.startswith("chat:"):
        name, *numbers = spec[len("chat:"):].split(":")
        if (name not in PROFILES or len(numbers) not in (1, 2) or not all(n.isdigit() and int(n) >= 1
                                                                          for n in numbers)):
            raise ConfigError(f"chat workload {spec!r}: expected chat:PROFILE:TURNS[:WINDOW] with a profile of "
                              f"{', '.join(PROFILES)} and TURNS, WINDOW >= 1")
        return ChatWorkload(PROFILES[name], *map(int, numbers), seed=seed)
    if spec in PROFILES:
        if spec == "text" and trace is not None and trace.input_lengths is not None:
            return TraceTextWorkload(trace, seed)
        return MixWorkload([PROFILES[spec]], [1.0], seed)
    if spec.endswith(".jsonl") or Path(spec).exists():
        return load_file_workload(spec, seed)
    raise ConfigError(
        f"unknown workload {spec!r}: expected one of {', '.join(PROFILES)}, 'mix:NAME=W,...', "
        "'chat:NAME:TURNS', a .jsonl file or a hydrad trace"
    )
