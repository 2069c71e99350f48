"""The request trace: records, the rotating writer, reading traces back, replaying them with the bench."""

from __future__ import annotations

import json

import pytest

from hydrad.bench.workloads import load_workload
from hydrad.config_file import load_config
from hydrad.errors import ConfigError
from hydrad.trace import FORMAT, TraceRecord, TraceWriter, make_record, read_trace, trace_files


def facts(i: int = 0, **kwargs) -> dict:
    out = dict(timestamp=1000.0 + i, prompt_tokens=300, images=[(640, 480, 256, 5)], output_tokens=16,
               max_tokens=16, finish_reason="length", preprocess=0.02, ttft=0.4, e2e=1.9,
               gaps=[0.1, 0.3, 0.2, 0.1, 0.5], stages={"encode_exec": 0.1, "prefill_queue": 0.05},
               instances=[0, 1])
    out.update(kwargs)
    return out


def writer(tmp_path, **kwargs) -> TraceWriter:
    kwargs.setdefault("max_bytes", 1 << 20)
    kwargs.setdefault("max_files", 3)
    return TraceWriter(tmp_path / "trace", model="m", deploy="1EP+1D", template_tokens=12, **kwargs)


def test_a_record_keeps_the_shape_and_latencies_and_reads_back():
    record = make_record(model="m", deploy="1EP+1D", template_tokens=12, **facts())
    assert record.text_tokens == 300 - 256
    # The gaps' percentiles as the bench computes them (linear interpolation).
    assert (record.num_gaps, record.tbt_p50, record.tbt_max) == (5, 0.2, 0.5)
    assert record.tbt_p90 == pytest.approx(0.42)
    obj = json.loads(json.dumps(record.to_json()))
    assert not {"prompt", "messages", "text"} & set(obj)  # shapes only, never content
    assert TraceRecord.from_json(obj).to_json() == obj
    with pytest.raises(ValueError):
        TraceRecord.from_json({**record.to_json(), "format": "other"})


def test_a_video_keeps_its_attention_span_and_frames_and_older_lines_read_as_images():
    # A video of six frames kept, three groups of frames (Qwen2-VL) of 120 patches each, then an image.
    record = make_record(model="m", deploy="2EPD", template_tokens=12,
                         **facts(images=[(320, 240, 90, 5, 360, 120, 6), (64, 64, 16, 100, 64, 0, 0)]))
    obj = json.loads(json.dumps(record.to_json()))
    assert [(i["span"], i["frames"]) for i in obj["images"]] == [(120, 6), (0, 0)]
    entry = TraceRecord.from_json(obj).bench_entry()  # the replay sends the video again
    assert entry["videos"] == [{"frames": 6, "width": 320, "height": 240, "fps": 2}]
    assert entry["images"] == [{"width": 64, "height": 64}]
    older = {**obj, "images": [{k: v for k, v in i.items() if k not in ("span", "frames")} for i in obj["images"]]}
    assert [(i.span, i.frames) for i in TraceRecord.from_json(older).images] == [(0, 0), (0, 0)]
    assert "videos" not in TraceRecord.from_json(older).bench_entry()
    from hydrad.planner.workload import Workload

    later = make_record(model="m", deploy="2EPD", template_tokens=12, **facts(1))
    (request, _) = Workload.from_records([TraceRecord.from_json(obj), later]).requests(1.0, 2)
    assert request.images == ((5, 90, 360, 120), (100, 16, 64, 0))  # to the simulator (test_simulator.py)


def test_the_prompt_tokens_found_cached_are_kept_and_read_where_older_lines_lack_them():
    record = make_record(model="m", deploy="2EPD", template_tokens=12, cached_tokens=288, **facts())
    obj = json.loads(json.dumps(record.to_json()))
    assert obj["cached_tokens"] == 288 and TraceRecord.from_json(obj).cached_tokens == 288
    older = {k: v for k, v in obj.items() if k != "cached_tokens"}
    assert TraceRecord.from_json(older).cached_tokens == 0
    with pytest.raises(ValueError):  # never the whole prompt: its last token is computed
        TraceRecord.from_json({**obj, "cached_tokens": 300})
    # The planner's request shapes carry it to the simulator.
    from hydrad.planner.workload import Workload

    later = make_record(model="m", deploy="2EPD", template_tokens=12, **facts(1))
    workload = Workload.from_records([record, later])
    assert [s.cached_tokens for s in workload.shapes] == [288, 0]
    assert [r.cached_tokens for r in workload.requests(1.0, 3)] == [288, 0, 288]


def test_a_prompts_completions_are_one_group_replayed_together():
    """Each of a request's ``n`` completions is a line; they carry one digest of their group,
    and the planner's replay sends them together, the one that computed the prompt first."""
    from hydrad.planner.workload import Workload

    first, other = (make_record(model="m", deploy="1EPD", template_tokens=12, group="chatcmpl-7-0",
                                cached_tokens=cached, **facts(0)) for cached in (0, 288))
    obj = json.loads(json.dumps(other.to_json()))
    assert obj["group"] == first.group and "chatcmpl" not in obj["group"]
    assert TraceRecord.from_json(obj).group == first.group
    alone = make_record(model="m", deploy="1EPD", template_tokens=12, **facts(1))
    assert "group" not in alone.to_json() and TraceRecord.from_json(alone.to_json()).group is None
    twin = make_record(model="m", deploy="1EPD", template_tokens=12, group="chatcmpl-9-0", **facts(2))
    # Written as they finished (the cached one first), read in arrival order, the group's
    # computing completion first.
    workload = Workload.from_records([other, first, alone, twin])
    assert [s.cached_tokens for s in workload.shapes] == [0, 288, 0, 0]
    assert [s.group for s in workload.shapes] == [0, 0, None, 3]
    # Cycled, each cycle's groups are their own; Poisson arrivals part them.
    assert [r.group for r in workload.requests(1.0, 6)] == [0, 0, None, 3, 4, 4]
    assert [r.group for r in workload.requests(1.0, 6, arrivals="poisson")] == [None] * 6


def test_the_writer_rotates_and_keeps_max_files(tmp_path):
    w = writer(tmp_path, max_bytes=2000)
    for i in range(40):
        w.record(**facts(i))
    w.close()
    files = trace_files(tmp_path / "trace")
    assert [f.name for f in files] == ["trace.2.jsonl", "trace.1.jsonl", "trace.jsonl"]
    assert all(f.stat().st_size <= 2000 for f in files)
    records = read_trace(tmp_path / "trace")
    # The newest records are kept, in arrival order, the oldest rotated out.
    stamps = [r.timestamp for r in records]
    assert stamps == sorted(stamps) and stamps[-1] == 1039.0 and stamps[0] > 1000.0
    assert w.recent(3) == (tmp_path / "trace" / "trace.jsonl").read_text().splitlines()[-3:]
    # The newest N: the same as the last N of all, read from the newest files only.
    for n in (1, 5, len(records) - 1, len(records), len(records) + 10):
        assert read_trace(tmp_path / "trace", newest=n) == records[-n:]
    # Since a time: the same as those of all that arrived then or later.
    for since in (0.0, stamps[0], stamps[len(stamps) // 2], stamps[-1], stamps[-1] + 1):
        assert read_trace(tmp_path / "trace", since=since) == [r for r in records if r.timestamp >= since]
    (tmp_path / "trace" / "trace.2.jsonl").write_text("not json\n")  # the oldest file is not read for a few
    assert read_trace(tmp_path / "trace", newest=3) == records[-3:]
    assert read_trace(tmp_path / "trace", since=stamps[-1]) == records[-1:]
    with pytest.raises(ConfigError, match="trace.2.jsonl:1"):
        read_trace(tmp_path / "trace")


def test_reading_filters_unfinished_requests_and_other_models(tmp_path, caplog):
    w = writer(tmp_path)
    w.record(**facts(0))
    w.record(**facts(1, finish_reason="abort", output_tokens=3))
    w.record(**facts(2, finish_reason="stop", output_tokens=7))
    w.close()
    path = tmp_path / "trace" / "trace.jsonl"
    assert [r.output_tokens for r in read_trace(path)] == [16, 7]
    assert len(read_trace(path, completed_only=False)) == 3
    assert read_trace(path, model="other") == []
    # A line that is not a record is skipped, and said once however often the trace is read;
    # lines none of which is a record are not a trace.
    path.write_text(path.read_text() + "{\"format\": \"" + FORMAT + "\"}\n")
    for _ in range(3):
        assert [r.output_tokens for r in read_trace(path)] == [16, 7]
    warnings = [r.getMessage() for r in caplog.records if r.name == "hydrad.trace"]
    assert len(warnings) == 1 and "trace.jsonl: skipped 1 line(s) that are not" in warnings[0] \
        and "(line 4: " in warnings[0], warnings
    path.write_text("not json\n{}\n")
    with pytest.raises(ConfigError, match="trace.jsonl:1"):
        read_trace(path)


def test_a_write_cut_short_loses_that_record_only(tmp_path, caplog):
    """The daemon killed in the middle of a write leaves part of a line: read back, the trace
    skips it (silently while it ends the file); the next writer ends the line before its
    first record, so that record stays whole."""
    w = writer(tmp_path)
    for i in range(3):
        w.record(**facts(i))
    w.close()
    path = tmp_path / "trace" / "trace.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + whole.splitlines(keepends=True)[0][:57])  # a fourth record, cut
    assert [r.timestamp for r in read_trace(path)] == [1000.0, 1001.0, 1002.0]
    assert not [r for r in caplog.records if r.name == "hydrad.trace"]
    w = writer(tmp_path)
    w.record(**facts(3))
    w.close()
    assert [r.timestamp for r in read_trace(path)] == [1000.0, 1001.0, 1002.0, 1003.0]
    assert len(path.read_text().splitlines()) == 5  # the cut line, ended, is skipped with a warning
    # A record cut inside a character (the text is not UTF-8 to its end) reads the same.
    path.write_bytes(path.read_bytes() + '{"prompt": "\u00e9'.encode()[:-1])
    assert [r.timestamp for r in read_trace(path)] == [1000.0, 1001.0, 1002.0, 1003.0]


def test_a_full_disk_drops_records_without_failing_and_the_writer_recovers(tmp_path, caplog, monkeypatch):
    """Writes that fail (a full disk; here, a rotation that cannot rename) drop their records
    with one error line and raise nothing into the request that ends; once the disk takes
    writes again, records follow, whole, and one line says so."""
    from pathlib import Path

    w = writer(tmp_path, max_bytes=1500)
    w.record(**facts(0))
    real_rename = Path.rename

    def no_space(self, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "rename", no_space)
    for i in range(1, 8):  # the second record or so needs a rotation: every one fails
        w.record(**facts(i))
    errors = [r.getMessage() for r in caplog.records if r.name == "hydrad.trace" and r.levelname == "ERROR"]
    assert len(errors) == 1 and "No space left on device; records are dropped until it is writable" in errors[0]
    dropped = 8 - w.num_records
    assert dropped >= 5
    monkeypatch.setattr(Path, "rename", real_rename)
    for i in range(8, 12):
        w.record(**facts(i))
    w.close()
    assert any("writable again" in r.getMessage() for r in caplog.records if r.name == "hydrad.trace")
    stamps = [r.timestamp for r in read_trace(tmp_path / "trace")]
    assert stamps[-4:] == [1008.0, 1009.0, 1010.0, 1011.0] and len(stamps) == 12 - dropped


def test_hydractl_bench_replays_a_trace(tmp_path):
    w = writer(tmp_path)
    w.record(**facts(2))
    w.record(**facts(0, finish_reason="abort"))
    w.record(**facts(1, images=[], prompt_tokens=40))
    w.close()
    workload = load_workload(str(tmp_path / "trace"), seed=0)
    # Aborted requests are left out; arrivals are the traced ones, in order.
    assert workload.timestamps == (1001.0, 1002.0)
    first, second = workload.request(0, 0), workload.request(1, 0)
    # The user's text without the chat template's tokens (the server adds them again).
    assert len(first.prompt.split()) == 40 - 12 and first.images == ()
    assert len(second.prompt.split()) == 300 - 256 - 12
    assert (second.images[0].width, second.images[0].height, second.output_tokens) == (640, 480, 16)


def test_hydractl_bench_replays_a_group_of_completions_as_one_request_with_n(tmp_path):
    """A prompt's three completions (one group, written as they finished, one of them
    aborted) are one request of ``n`` 2, of their mean length, sent at the group's first
    arrival; a request of its own and another group stay apart."""
    w = writer(tmp_path)
    w.record(**facts(0, group="chatcmpl-1-0", output_tokens=10))
    w.record(**facts(1, images=[], prompt_tokens=40))
    w.record(**facts(0, group="chatcmpl-1-0", output_tokens=13))
    w.record(**facts(0, group="chatcmpl-1-0", finish_reason="abort"))
    w.record(**facts(2, group="chatcmpl-2-0", output_tokens=5))
    w.close()
    workload = load_workload(str(tmp_path / "trace"), seed=0)
    assert workload.timestamps == (1000.0, 1001.0, 1002.0)
    group, alone, other = (workload.request(i, 0) for i in range(3))
    assert (group.n, group.output_tokens, len(group.images)) == (2, 12, 1)  # round(11.5): to the even
    assert (alone.n, other.n, other.output_tokens) == (1, 1, 5)


def test_the_trace_section_of_the_config_file(tmp_path):
    path = tmp_path / "hydrad.toml"
    path.write_text('[trace]\nenabled = false\ndir = "/srv/trace"\nmax_file_mb = 8\nmax_files = 2\n')
    config = load_config(path)
    assert (config.trace.enabled, str(config.trace.directory), config.trace.max_file_mb) == (False, "/srv/trace", 8)
    path.write_text("[trace]\nrotate = 3\n")
    with pytest.raises(ConfigError, match="unknown key trace.rotate"):
        load_config(path)
    path.write_text("[trace]\nmax_files = 0\n")
    with pytest.raises(ConfigError, match="max_files"):
        load_config(path)


def test_the_validation_daemons_config_reads_back_as_written(tmp_path):
    import dataclasses

    from hydrad.planner.validate import config_toml

    path = tmp_path / "in.toml"
    path.write_text('seed = 3\n[slo]\nttft = 1.5\ntbt = 0.08\n[cache]\nnum_kv_blocks = 100\n'
                    '[server.remote_images]\nallowed_domains = ["a.example"]\n[parallel]\ndeploy = "1EP+1D"\n'
                    '[planner]\nreuse_hours = 0.0\nmargin = 0.5\n')
    config = load_config(path)
    config = dataclasses.replace(config, trace=dataclasses.replace(config.trace, dir="/srv/t", enabled=False))
    out = tmp_path / "out.toml"
    out.write_text(config_toml(config))
    assert load_config(out) == config


def test_a_priced_prompt_is_kept_and_replayed_as_one():
    """A scoring request (its prompt's log-probabilities asked for) is marked, and the planner
    replays it as one: its prefill prices every position (test_simulator.py)."""
    record = make_record(model="m", deploy="2EPD", template_tokens=12, prompt_logprobs=True, **facts())
    obj = json.loads(json.dumps(record.to_json()))
    assert obj["prompt_logprobs"] is True and TraceRecord.from_json(obj).prompt_logprobs
    plain = make_record(model="m", deploy="2EPD", template_tokens=12, **facts(1))
    assert "prompt_logprobs" not in plain.to_json() and not TraceRecord.from_json(plain.to_json()).prompt_logprobs
    # A live replay (``hydractl bench --workload <trace>``) sends it as a scoring request again.
    assert record.bench_entry()["prompt_logprobs"] is True and "prompt_logprobs" not in plain.bench_entry()
    from hydrad.planner.workload import Workload

    assert [r.prompt_logprobs for r in Workload.from_records([record, plain]).requests(1.0, 3)] == [True, False, True]


def test_the_processor_service_time_is_the_median_traced_time_per_image_count():
    from hydrad.planner.workload import Workload

    # Text-only requests took 2-10 ms, one-image ones 10-50 ms (larger images, and a few
    # that waited for the processor): each replayed request takes its count's median.
    times = {0: [0.002, 0.004, 0.006, 0.008, 0.010], 1: [0.010, 0.020, 0.030, 0.040, 0.050]}
    records = [make_record(model="m", deploy="1EP+1D", template_tokens=12,
                           **facts(10 * n + i, preprocess=t, images=[(640, 480, 256, 5)] * n,
                                   prompt_tokens=300 if n else 44))
               for n, ts in times.items() for i, t in enumerate(ts)]
    workload = Workload.from_records(records)
    by_images = {len(s.images): s.preprocess for s in workload.shapes}
    assert by_images == {0: 0.006, 1: 0.030}


def test_a_found_images_turn_replays_the_found_turns_time():
    """A chat's turns resend its image: the first is processed (8-9 ms), the later ones find it
    preprocessed (1.5-2 ms). Each replays the median of its own kind, not of the more numerous
    later turns; the count of found images is kept in the trace and read back (0 where older
    lines lack it), and a count over the images is a malformed line."""
    from hydrad.planner.workload import Workload

    image = [(640, 480, 256, 5)]
    records = [make_record(model="m", deploy="1EPD", template_tokens=12, processing=t, images_found=found,
                           **facts(i, images=image, prompt_tokens=300))
               for i, (t, found) in enumerate([(0.008, 0), (0.0015, 1), (0.0018, 1), (0.009, 0), (0.0020, 1),
                                               (0.0016, 1), (0.0085, 0)])]
    shapes = Workload.from_records(records).shapes
    assert [s.preprocess for s in shapes] == [0.0085, 0.0018, 0.0018, 0.0085, 0.0018, 0.0018, 0.0085]
    obj = json.loads(json.dumps(records[1].to_json()))
    assert obj["images_found"] == 1 and TraceRecord.from_json(obj).images_found == 1
    assert "images_found" not in records[0].to_json()
    assert TraceRecord.from_json({k: v for k, v in obj.items() if k != "images_found"}).images_found == 0
    with pytest.raises(ValueError):
        TraceRecord.from_json({**obj, "images_found": 2})


def test_the_processing_time_is_kept_and_read_where_older_lines_lack_it():
    record = make_record(model="m", deploy="2EPD", template_tokens=12, processing=0.012, **facts(preprocess=0.9))
    obj = json.loads(json.dumps(record.to_json()))
    assert obj["processing"] == 0.012 and TraceRecord.from_json(obj).processing == 0.012
    older = {k: v for k, v in obj.items() if k != "processing"}
    assert TraceRecord.from_json(older).processing is None
    assert "processing" not in make_record(model="m", deploy="2EPD", template_tokens=12, **facts()).to_json()


def test_a_trace_recorded_at_overload_replays_the_processors_own_time():
    """Requests that waited ~1 s for the Request Processor (a trace recorded at overload) but
    took 10-14 ms of its time each: the replay's service time is theirs, not the waits'. A
    line without the processing time (an older trace) falls back to its preprocess time."""
    from hydrad.planner.workload import Workload

    records = [make_record(model="m", deploy="1EP+1D", template_tokens=12, processing=0.010 + 0.001 * i,
                           **facts(i, preprocess=0.9 + 0.01 * i)) for i in range(5)]
    assert {s.preprocess for s in Workload.from_records(records).shapes} == {0.012}
    older = [make_record(model="m", deploy="1EP+1D", template_tokens=12, **facts(i, preprocess=0.9 + 0.01 * i))
             for i in range(5)]
    assert [s.preprocess for s in Workload.from_records(older).shapes] == [pytest.approx(0.92)] * 5
    # mixed: each record's own time in the median (three processing times, two waits)
    mixed = records[:3] + older[3:]
    assert {s.preprocess for s in Workload.from_records(mixed).shapes} == {0.012}


def test_reading_since_a_time_reaches_into_an_older_file_past_a_long_request(tmp_path):
    """A request is written when it ends: the newest file can hold one that arrived before
    ``since`` (a long one) while the file before it holds requests that arrived after."""
    from hydrad.trace import make_record

    def line(t, e2e=1.9):
        return json.dumps(make_record(model="m", deploy="2EPD", template_tokens=0, **facts(0, timestamp=t, e2e=e2e))
                          .to_json()) + "\n"

    folder = tmp_path / "trace"
    folder.mkdir()
    (folder / "trace.1.jsonl").write_text("".join(line(1000.0 + i) for i in range(10)))
    (folder / "trace.jsonl").write_text(line(990.0, e2e=25.0) + "".join(line(1010.0 + i) for i in range(5)))
    stamps = [r.timestamp for r in read_trace(folder, since=1005.0)]
    assert stamps == [1005.0 + i for i in range(10)]
    assert [r.timestamp for r in read_trace(folder, since=985.0)][:2] == [990.0, 1000.0]
