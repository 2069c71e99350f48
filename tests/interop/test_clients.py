"""The ecosystem's clients, unmodified, against a real daemon on the tiny model: NVIDIA's
aiperf, guidellm and the official ``openai`` client, and EleutherAI's lm-evaluation-harness.
Each must finish without errors, and what it reports (requests, output tokens, mean TTFT;
the harness's log-likelihoods) must agree with hydrad's own ``/metrics`` counters for the
same requests (with transformers, for the log-likelihoods)."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import tempfile
import time

import numpy as np
import openai
import pytest
from interop_support import assert_ttft_agrees, tool_env
from PIL import Image

pytestmark = pytest.mark.slow

NUM_REQUESTS = 12  # per benchmark tool
OUTPUT_TOKENS = 8
MAX_TOKENS = 10  # openai client
NUM_OPENAI_REQUESTS = 4  # of each kind


# -- aiperf ------------------------------------------------------------------------------------

def test_aiperf_profile_streams_chat_with_images(daemon, model_name, tiny_llava_dir, hydrad_counts, tmp_path):
    out_dir = tmp_path / "aiperf"
    command = [
        sys.executable, "-m", "aiperf", "profile",
        "--url", daemon.url, "--model", model_name, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(tiny_llava_dir),
        "--request-count", str(NUM_REQUESTS), "--concurrency", "2", "--random-seed", "7",
        "--prompt-input-tokens-mean", "24", "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(OUTPUT_TOKENS), "--prompt-output-tokens-stddev", "0",
        "--image-batch-size", "1", "--image-width-mean", "64", "--image-height-mean", "48",
        "--extra-inputs", "ignore_eos:true",
        # Token counts from hydrad's usage (per chunk too) rather than re-tokenizing the text:
        # the text of arbitrary tokens does not always re-tokenize to as many tokens.
        "--use-server-token-count", "--per-chunk-usage",
        "--no-gpu-telemetry", "--ui-type", "none", "--output-artifact-dir", str(out_dir),
    ]
    # aiperf's offline mode looks the tokenizer up in the hub cache and refuses a local
    # folder; a local folder is read from disk without it, so nothing is fetched either way.
    # It leaves dataset files and socket folders in the temp directory: give it one of its
    # own, short (its IPC socket paths must stay under the 107-character limit).
    with tempfile.TemporaryDirectory(prefix="aiperf-") as tmp:
        env = tool_env(HF_HUB_OFFLINE=None, TRANSFORMERS_OFFLINE=None, TMPDIR=tmp)
        run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    hydrad = hydrad_counts()

    assert not report["was_cancelled"] and report["error_summary"] == []
    assert report["request_count"]["avg"] == NUM_REQUESTS == hydrad.requests and hydrad.failed == 0
    assert report["num_images"]["sum"] == NUM_REQUESTS
    assert report["output_sequence_length"]["sum"] == NUM_REQUESTS * OUTPUT_TOKENS == hydrad.generation_tokens
    assert report["time_to_first_token"]["unit"] == "ms" and report["time_to_first_token"]["count"] == NUM_REQUESTS
    assert_ttft_agrees(report["time_to_first_token"]["avg"] / 1000, hydrad)


# -- guidellm ----------------------------------------------------------------------------------

def test_guidellm_poisson_text_and_images(daemon, tiny_llava_dir, hydrad_counts, tmp_path):
    report_path = tmp_path / "guidellm.json"
    command = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={daemon.url},request_format=/v1/chat/completions",
        "--profile", "kind=poisson,rate=4",
        "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens=24,output_tokens={OUTPUT_TOKENS}",
        "--data", "kind=synthetic_image,width=64,height=48",
        "--tokenizer", f"kind=huggingface_auto,model={tiny_llava_dir}",
        "--seed", "kind=static,value=7",
        "--output", f"kind=json,path={report_path}",
        "--disable-console-interactive",
    ]
    run = subprocess.run(command, env=tool_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (benchmark,) = json.loads(report_path.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    hydrad = hydrad_counts()

    assert metrics["request_totals"] == {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0,
                                         "total": NUM_REQUESTS}
    assert hydrad.requests == NUM_REQUESTS and hydrad.failed == 0
    sent = [json.loads(r["request_args"])["body"] for r in benchmark["requests"]["successful"]]
    assert all(any(part["type"] == "image_url" for part in body["messages"][-1]["content"]) for body in sent)
    output_tokens = metrics["output_token_count"]["successful"]
    assert output_tokens["total_sum"] == NUM_REQUESTS * OUTPUT_TOKENS == hydrad.generation_tokens
    assert metrics["time_to_first_token_ms"]["successful"]["count"] == NUM_REQUESTS
    assert_ttft_agrees(metrics["time_to_first_token_ms"]["successful"]["mean"] / 1000, hydrad)


# -- lm-evaluation-harness ----------------------------------------------------------------------

LM_EVAL_DOCS = [("The cat sat on", ["the mat", "a red ball", "the old house"]),
                ("A small robot found", ["a blue box", "the garden", "a boat"]),
                ("Once upon a time", ["there was", "a dog ran", "the end"]),
                ("My friend painted", ["the house", "a picture of the sea", "it"])]
LM_EVAL_BATCH = 4


def test_lm_eval_harness_loglikelihoods_are_transformers(daemon, model_name, tiny_llava_dir, hydrad_counts,
                                                         tmp_path):
    """EleutherAI's lm-evaluation-harness, its ``local-completions`` model, on a multiple-choice
    task and a perplexity task (a local dataset): it batches prompts of token ids and reads
    each continuation's log-likelihood from ``echo`` with ``logprobs``. Every log-likelihood it
    records equals transformers' forward over the same tokens. It tokenizes through the daemon
    (``/tokenizer_info``, ``/tokenize``), which it detects by itself."""
    import torch
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": choices, "label": 0,
                                        "text": f"{c} {choices[0]}. " * 3}) + "\n"
                            for c, choices in LM_EVAL_DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tmp_path / "mc.yaml").write_text(
        "task: hydrad_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n")
    (tmp_path / "ppl.yaml").write_text(
        "task: hydrad_ppl\n" + common + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions",
        # No tokenizer named: the harness finds the daemon's tokenizer routes and tokenizes there.
        "--model_args", f"model={model_name},base_url={daemon.url}/v1/completions,num_concurrent=2,max_retries=1",
        "--batch_size", str(LM_EVAL_BATCH), "--tasks", "hydrad_mc,hydrad_ppl", "--include_path", str(tmp_path),
        "--output_path", str(tmp_path / "out"), "--log_samples",
    ]
    run = subprocess.run(command, env=tool_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Using remote tokenizer backend" in run.stdout + run.stderr
    assert hydrad_counts().failed == 0

    (results,) = (tmp_path / "out").glob("*/results_*.json")
    assert results.is_file()
    (samples,) = (tmp_path / "out").glob("*/samples_hydrad_mc_*.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()
    checked = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for args, ((loglikelihood, greedy),) in zip(sample["arguments"].values(), sample["resps"]):
            # The harness tokenizes a context and its continuation without special tokens.
            whole = tokenizer(args["arg_0"] + args["arg_1"], add_special_tokens=False)["input_ids"]
            start = len(tokenizer(args["arg_0"], add_special_tokens=False)["input_ids"])
            with torch.no_grad():
                raw = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].float(), dim=-1)
            want = sum(raw[p - 1, whole[p]].item() for p in range(start, len(whole)))
            assert float(loglikelihood) == pytest.approx(want, abs=1e-4), args
            assert (greedy == "True") == all(raw[p - 1].argmax().item() == whole[p] for p in range(start, len(whole)))
            checked += 1
    assert checked == sum(len(choices) for _, choices in LM_EVAL_DOCS)
    (rolling,) = (tmp_path / "out").glob("*/samples_hydrad_ppl_*.jsonl")
    lines = rolling.read_text().splitlines()
    assert len(lines) == len(LM_EVAL_DOCS) and all(float(json.loads(x)["resps"][0][0]) < 0 for x in lines)


# -- the openai client -------------------------------------------------------------------------

def image_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(i)}},
                                         {"type": "text", "text": f"What is in picture {i}?"}]}]


@pytest.fixture(scope="module")
def client(daemon, model_name):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
    # The client's first request sets it up (imports, connection pool): tens of ms that are
    # not the server's. Module-scoped, so before the tests take hydrad's counters.
    client.chat.completions.create(model=model_name, messages=messages(99), max_tokens=1)
    return client


def test_streamed_chat_with_images(client, model_name, hydrad_counts):
    ttfts, completion_tokens = [], 0
    for i in range(NUM_OPENAI_REQUESTS):
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=model_name, messages=messages(i), max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = []
        for chunk in stream:
            if chunk.choices and not chunks:
                ttfts.append(time.perf_counter() - start)
            chunks.append(chunk)
        content, usage = [c for c in chunks if c.choices], chunks[-1].usage
        # One chunk per token, the role with the first, the finish reason with the last.
        assert len(content) == usage.completion_tokens == MAX_TOKENS
        assert content[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in content] == [None] * (MAX_TOKENS - 1) + ["length"]
        completion_tokens += usage.completion_tokens
    hydrad = hydrad_counts()
    assert hydrad.requests == NUM_OPENAI_REQUESTS and hydrad.failed == 0
    assert hydrad.generation_tokens == completion_tokens
    assert_ttft_agrees(sum(ttfts) / len(ttfts), hydrad)


def test_whole_chat_with_images(client, model_name, hydrad_counts):
    completion_tokens = 0
    for i in range(NUM_OPENAI_REQUESTS):
        # OpenAI's bookkeeping fields, which clients send to any server, are taken.
        bookkeeping = {"store": False, "metadata": {"run": "interop"}, "service_tier": "auto",
                       "modalities": ["text"], "prompt_cache_key": f"k{i}", "safety_identifier": "tester"}
        resp = client.chat.completions.create(model=model_name, messages=messages(i), max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True, **bookkeeping})
        assert resp.choices[0].message.role == "assistant" and resp.choices[0].finish_reason == "length"
        assert isinstance(resp.choices[0].message.content, str)
        assert resp.usage.completion_tokens == MAX_TOKENS and resp.usage.prompt_tokens > 0
        completion_tokens += resp.usage.completion_tokens
    hydrad = hydrad_counts()
    assert hydrad.requests == NUM_OPENAI_REQUESTS and hydrad.failed == 0
    assert hydrad.generation_tokens == completion_tokens


def test_responses_api_whole_and_streamed(client, model_name, hydrad_counts):
    """OpenAI's Responses API through the official client: the same greedy answer as the chat
    route's for the same messages (instructions as its system message), whole and streamed,
    the stream's events in OpenAI's order and numbered, the usage as hydrad counts it."""
    chat = client.chat.completions.create(
        model=model_name, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": "Answer briefly."}, *messages(5)])
    url = image_url(5)
    request = dict(model=model_name, instructions="Answer briefly.", max_output_tokens=MAX_TOKENS, temperature=0,
                   input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                       {"type": "input_text", "text": "What is in picture 5?"}]}],
                   extra_body={"ignore_eos": True})
    whole = client.responses.create(**request)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == MAX_TOKENS

    events = list(client.responses.create(**request, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * MAX_TOKENS,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == MAX_TOKENS
    hydrad = hydrad_counts()
    assert hydrad.requests == 3 and hydrad.failed == 0 and hydrad.generation_tokens == 3 * MAX_TOKENS


def test_responses_api_refuses_what_it_does_not_serve(client, model_name):
    """Conversation objects, tools other than functions and unknown fields: a 400 naming the
    field, and the daemon serves on."""
    for extra, param in (({"conversation": "conv_1"}, "conversation"),
                         ({"previous_response_id": "resp_1"}, "previous_response_id"),  # not kept
                         ({"tools": [{"type": "web_search"}]}, "tools[0]"),
                         ({"frobnicate": 1}, "frobnicate")):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=model_name, input="hi", max_output_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param, info.value.body
    # An image the Request Processor cannot decode is named as the input item it came in.
    garbage = "data:image/png;base64," + base64.b64encode(b"garbage" * 10).decode()
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model_name, max_output_tokens=2, instructions="Be brief.", input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": garbage}]}])
    assert info.value.body["param"] == "input[0].content[0]", info.value.body
    assert client.responses.create(model=model_name, input="hi", max_output_tokens=2).status == "incomplete"
    # A response never kept: a 404 that says so.
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel,
                 client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as info:
            call("resp_1")
        assert info.value.body["code"] == "response_not_found", info.value.body


def test_responses_api_continues_a_kept_response(client, model_name):
    """A response is kept (OpenAI's default ``store``): ``previous_response_id`` continues it
    with the greedy answer the whole conversation sent as input gets, streamed or not; the
    kept responses are retrieved as answered, list their input items, and once one is deleted
    the conversations through it are refused by name."""
    question = {"role": "user", "content": [{"type": "input_image", "image_url": image_url(7)},
                                            {"type": "input_text", "text": "What is in picture 7?"}]}
    settings = dict(model=model_name, max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    first = client.responses.create(**settings, input=[question])
    assert first.store is True
    second = client.responses.create(**settings, previous_response_id=first.id, input="And its colors?")
    assert second.previous_response_id == first.id
    conversation = [question, {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
                    {"role": "user", "content": "And its colors?"}]
    explicit = client.responses.create(**settings, input=conversation, store=False)
    assert second.output_text == explicit.output_text
    assert second.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(item.type, item.role) for item in items] == [("message", "user"), ("message", "assistant"),
                                                          ("message", "user")]
    assert items[1].id == first.output[0].id and items[1].content[0].text == first.output_text
    page = client.responses.input_items.list(second.id, limit=2)  # newest first
    assert [item.id for item in page.data] == [items[2].id, items[1].id] and page.has_more

    events = list(client.responses.create(**settings, previous_response_id=second.id, input="Thanks.", stream=True))
    third = events[-1].response
    conversation += [{"role": "assistant", "content": [{"type": "output_text", "text": second.output_text}]},
                     {"role": "user", "content": "Thanks."}]
    assert third.output_text == client.responses.create(**settings, input=conversation, store=False).output_text
    assert client.responses.retrieve(third.id).output_text == third.output_text

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**settings, previous_response_id=third.id, input="More?")
    assert info.value.body["code"] == "previous_response_not_found" and first.id in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):  # with a turn gone, its list of items is not whole
        client.responses.input_items.list(third.id)


def test_responses_api_background_responses(daemon, client, model_name):
    """``background``: answered at once (queued), polled to the greedy answer the request
    gets synchronously; continued once it has ended, refused while it runs; cancelled while it
    runs (its request aborted on the worker: no token after, the metric counts an abort), and
    cancel refused for what is not a running background response."""
    import re

    from daemon_process import http, wait_for

    def aborted() -> float:
        text = http("GET", daemon.url + "/metrics").text
        found = re.search(r'^hydrad_requests_finished_total\{finish_reason="abort"[^}]*\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    def poll(response_id: str):
        response = client.responses.retrieve(response_id)
        deadline = time.monotonic() + 30
        while response.status in ("queued", "in_progress") and time.monotonic() < deadline:
            time.sleep(0.05)
            response = client.responses.retrieve(response_id)
        return response

    settings = dict(model=model_name, max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    question = [{"role": "user", "content": [{"type": "input_image", "image_url": image_url(13)},
                                             {"type": "input_text", "text": "What is in picture 13?"}]}]
    created = client.responses.create(**settings, input=question, background=True)
    assert created.status == "queued" and created.background is True and created.output == []
    done = poll(created.id)
    synchronous = client.responses.create(**settings, input=question, store=False)
    assert done.status == "incomplete" and done.output_text == synchronous.output_text
    assert done.usage.output_tokens == MAX_TOKENS and done.background is True
    follow = client.responses.create(**settings, previous_response_id=done.id, input="And its colors?")
    conversation = [*question, {"role": "assistant", "content": [{"type": "output_text", "text": done.output_text}]},
                    {"role": "user", "content": "And its colors?"}]
    assert follow.output_text == client.responses.create(**settings, input=conversation, store=False).output_text
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(done.id)
    assert "already incomplete" in info.value.body["message"], info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(follow.id)
    assert "synchronous" in info.value.body["message"], info.value.body

    aborts = aborted()
    long = client.responses.create(model=model_name, input="Tell me everything.", max_output_tokens=1500,
                                   background=True, extra_body={"ignore_eos": True})
    assert wait_for(lambda: client.responses.retrieve(long.id).status == "in_progress", 10)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**settings, previous_response_id=long.id, input="More?")
    assert info.value.body["code"] == "previous_response_in_progress", info.value.body
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.cancel(long.id).status == "cancelled"
    assert wait_for(lambda: aborted() == aborts + 1, 10)  # ended on the worker, as an abort
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as info:  # not streamed: no events to follow
        client.responses.retrieve(done.id, stream=True)
    assert info.value.body["param"] == "stream", info.value.body


def test_responses_api_background_streams_followed_again(daemon, client, model_name):
    """``background`` with ``stream``: the events as they come, from ``response.created``
    (queued); a client that leaves mid-stream ends nothing, and follows the response again
    from the last event it had (``starting_after``) to the greedy answer the request gets
    synchronously; the events kept are replayed whole once it has ended, and a cancel ends
    a follower's stream."""
    from daemon_process import wait_for

    settings = dict(model=model_name, max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    question = [{"role": "user", "content": [{"type": "input_image", "image_url": image_url(14)},
                                             {"type": "input_text", "text": "What is in picture 14?"}]}]
    first = []
    with client.responses.create(**settings, input=question, background=True, stream=True) as stream:
        for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta":
                break  # the client leaves
    assert [e.type for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert first[0].response.status == first[1].response.status == "queued" and first[0].response.background
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    synchronous = client.responses.create(**settings, input=question, store=False)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == synchronous.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == synchronous.output_text
    assert client.responses.retrieve(response_id).output_text == synchronous.output_text
    replayed = list(client.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in events]

    long = client.responses.create(model=model_name, input="Tell me everything.", max_output_tokens=1500,
                                   background=True, stream=True, extra_body={"ignore_eos": True})
    created = next(iter(long))
    long.close()
    follower = client.responses.retrieve(created.response.id, stream=True)
    followed = []
    for event in follower:
        followed.append(event)
        if event.type == "response.output_text.delta" and followed[-2].type != event.type:
            assert client.responses.cancel(created.response.id).status == "cancelled"
    deltas = [e for e in followed if e.type == "response.output_text.delta"]
    assert followed[0].model_dump() == created.model_dump() and 0 < len(deltas) < 1500  # ended by the cancel
    assert wait_for(lambda: client.responses.retrieve(created.response.id).status == "cancelled", 10)


def test_a_kept_responses_input_is_held_in_the_body_budget_until_its_answer_ends(daemon, client, model_name):
    """While a kept response streams, its input (an image here) stays counted in the request
    bodies' budget (it is kept with the answer); one sent with ``store`` false leaves it once
    processed; both leave nothing once their answers end."""
    import re

    from daemon_process import http, wait_for

    def in_use() -> float:
        text = http("GET", daemon.url + "/metrics").text
        return float(re.search(r"^hydrad_request_body_bytes_in_use\{[^}]*\} (\S+)$", text, re.M).group(1))

    question = [{"role": "user", "content": [{"type": "input_image", "image_url": image_url(11)},
                                             {"type": "input_text", "text": "What is in picture 11?"}]}]
    held = {}
    for store in (True, False):
        stream = client.responses.create(model=model_name, input=question, max_output_tokens=160, temperature=0,
                                         stream=True, store=store, extra_body={"ignore_eos": True})
        for event in stream:
            if event.type == "response.output_text.delta":  # generating: its processing is over
                held[store] = in_use()
                break
        for _ in stream:
            pass
        assert wait_for(lambda: in_use() == 0, 10)
    assert held[True] > len(image_url(11)) and held[False] == 0, held


def test_responses_api_function_calls(client, model_name):
    """A named function's call through the Responses API: the same greedy call as the chat
    route's, whole and streamed, as a function_call item with its arguments. (No whitespace in
    the arguments: a random model, free to put it between JSON tokens, may put nothing else.)"""
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                  "required": ["city"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Weather in Paris?"}], temperature=0, max_tokens=40,
        tools=[{"type": "function", "function": {"name": "weather", "parameters": parameters}}],
        tool_choice={"type": "function", "function": {"name": "weather"}})
    [chat_call] = chat.choices[0].message.tool_calls
    assert json.loads(chat_call.function.arguments).keys() == {"city"}
    request = dict(model=model_name, input="Weather in Paris?", temperature=0, max_output_tokens=40,
                   tools=[{"type": "function", "name": "weather", "parameters": parameters, "strict": True}],
                   tool_choice={"type": "function", "name": "weather"})
    whole = client.responses.create(**request)
    assert whole.status == "completed", whole
    [call] = whole.output
    assert (call.type, call.name, call.arguments) == ("function_call", "weather", chat_call.function.arguments)
    events = list(client.responses.create(**request, stream=True))
    done = events[-1]
    assert done.type == "response.completed" and [o.type for o in done.response.output] == ["function_call"]
    streamed = done.response.output[0]
    assert streamed.arguments == call.arguments == "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # The client's stream helper, which builds the response from the events and checks them.
    with client.responses.stream(**request) as helper:
        final = helper.until_done().get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "weather", call.arguments)]
