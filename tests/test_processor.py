"""The Request Processor's checks before the expensive work, its messages, and calls from
several threads at once."""

from __future__ import annotations

import base64
import io
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from hydrad.errors import RequestError
from hydrad.processor import InputProcessor, max_chars_per_token


@pytest.fixture(scope="module")
def processor(tiny_llava_dir):
    return InputProcessor(tiny_llava_dir, max_images_per_request=4, max_image_pixels=10_000,
                          max_request_pixels=15_000)


def png_url(width: int, height: int, seed: int = 0) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (seed * 40 % 256, 90, 200)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# -- the prompt's length, before tokenizing ----------------------------------------------------------


class Spy:
    """Stands in for the HF processor: any call means the tokenizer would have run."""

    def __getattr__(self, name):
        raise AssertionError(f"the HF processor was used ({name})")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the HF processor was called")


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(tiny_llava_dir):
    processor = InputProcessor(tiny_llava_dir)
    assert processor.max_prompt_chars == processor.max_model_len * max_chars_per_token(processor.tokenizer)
    processor._idle.get_nowait()
    processor._idle.put(Spy())
    text = "hello " * 3_500_000  # 21 MB: about 40 s of tokenizing on this tokenizer
    start = time.monotonic()
    for call in (lambda: processor.process_chat([{"role": "user", "content": text}]),
                 lambda: processor.process_prompt(text),
                 lambda: processor.inspect_chat(user({"type": "text", "text": text}))):
        with pytest.raises(RequestError, match=f"holds? at most {processor.max_prompt_chars} characters") as info:
            call()
        assert info.value.code == "context_length_exceeded" and "\n" not in str(info.value)
    assert time.monotonic() - start < 1.0
    # At the bound the text goes on to the tokenizer (here, the spy).
    with pytest.raises(AssertionError, match="HF processor"):
        processor.process_prompt("x" * processor.max_prompt_chars)


def tokenizer_with(normalizer=None, pre_tokenizer=pre_tokenizers.ByteLevel(), **bpe) -> Tokenizer:
    """A byte-level BPE (every byte in the vocabulary) whose longest piece is 5 characters,
    with the normalizer and pre-tokenizer given."""
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    for piece in ("ab", "aaaab", "<unk>"):
        vocab[piece] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, [("a", "b")], **bpe))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer


class Backend:
    def __init__(self, tokenizer: Tokenizer):
        self.backend_tokenizer = tokenizer


@pytest.mark.parametrize("tokenizer, bound", [
    (tokenizer_with(), 5),  # the longest piece, "aaaab"
    (tokenizer_with(normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None,
                    byte_fallback=True, unk_token="<unk>", fuse_unk=True), 5),  # Llama's
    (tokenizer_with(normalizers.NFC()), 20),  # Qwen2's: composition, up to 4:1
    (tokenizer_with(normalizers.Replace("  ", " ")), 10),
    (tokenizer_with(None, None, unk_token="<unk>"), 5),  # one unknown token per unknown character
    (tokenizer_with(normalizers.Strip()), None),  # deletes whitespace
    (tokenizer_with(normalizers.Replace(" ", "")), None),
    (tokenizer_with(pre_tokenizer=pre_tokenizers.Whitespace()), None),  # drops whitespace
    (tokenizer_with(None, None), None),  # drops characters outside its vocabulary
    (tokenizer_with(None, None, unk_token="<unk>", fuse_unk=True), None),  # any run of them: one token
])
def test_characters_per_token_bound(tokenizer, bound):
    assert max_chars_per_token(Backend(tokenizer)) == bound


def test_the_bound_holds_on_texts_made_to_be_short_in_tokens(processor):
    """No text is fewer than len(text) / bound tokens: runs of the longest pieces, special
    tokens, multi-byte characters and composing sequences among random text."""
    tokenizer = processor.tokenizer
    bound = max_chars_per_token(tokenizer)
    longest = max(tokenizer.get_vocab(), key=len)
    rng = random.Random(0)
    alphabet = "ab cdé😀\u0301\n<image></s>" + longest
    texts = [longest * 50, "<image>" * 50, "</s>" * 40, "😀" * 30, "e\u0301" * 30]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))) for _ in range(200)]
    for text in texts:
        num_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert num_tokens * bound >= len(text), text


# -- images: per image and per request, from the headers ------------------------------------------


def test_pixels_per_request_are_checked_from_the_headers(processor):
    size = processor.inspect_chat(user(image(png_url(100, 100)), image(png_url(50, 50, 1)),
                                       {"type": "text", "text": "two"}))
    assert size.image_sizes == ((100, 100), (50, 50)) and size.num_pixels == 12_500 and size.num_chars == 3
    for call in (processor.inspect_chat, processor.process_chat):
        with pytest.raises(RequestError, match="the request's 2 images have 15100 pixels in all; the limit is 15000") \
                as info:
            call(user(image(png_url(100, 100)), image(png_url(100, 51, 1))))
        assert info.value.param == "messages"
    at_limit = user(image(png_url(100, 100)), image(png_url(100, 50, 1)))
    assert processor.inspect_chat(at_limit).num_pixels == 15_000


@pytest.mark.parametrize("message, error, param", [
    (user(image("")), "messages[0].content[0].image_url.url is empty", "messages[0].content[0]"),
    (user({"type": "image_url", "image_url": {}}), "messages[0].content[0].image_url.url must be a string",
     "messages[0].content[0]"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}],
     "messages[0]: earlier tool_calls are not supported: this model's chat template has no tool calls",
     "messages[0].tool_calls"),
    ([{"role": "tool", "content": "42", "tool_call_id": "1"}], "messages[0]: tool messages are not supported",
     "messages[0].role"),
    ([{"role": "function", "content": "42", "name": "f"}], "messages[0]: function messages and function_call are "
     "the deprecated form", "messages[0].role"),
    ([{"role": "user", "content": None}], "messages[0].content must be a string or a non-empty list of parts, got null",
     "messages[0].content"),
    (user(image("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n\0\0").decode())),
     "could not decode the image: the data is not a png, jpeg, webp or gif image, or it is truncated",
     "messages[0].content[0]"),
])
def test_errors_say_what_is_wrong(processor, message, error, param):
    for call in (processor.inspect_chat, processor.process_chat):
        with pytest.raises(RequestError) as info:
            call(message)
        assert str(info.value).startswith(error) and info.value.param == param
        assert "0x" not in str(info.value) and "\n" not in str(info.value)


# -- several threads at once -------------------------------------------------------------------------


def test_calls_from_several_threads_give_what_one_thread_gives(tiny_llava_dir):
    """No lock: calls run at once, each on an HF processor of its own (transformers does not
    promise that one is safe to share between threads), and give what one thread gives."""
    processor = InputProcessor(tiny_llava_dir, max_images_per_request=2)
    jobs = [user(image(png_url(40 + 9 * i, 30 + 7 * i, i)), {"type": "text", "text": f"picture {i} " * (i + 1)})
            for i in range(12)] + [[{"role": "user", "content": "word " * (50 * i + 1)}] for i in range(12)]
    expected = [processor.process_chat(job) for job in jobs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(processor.process_chat, jobs))
            for a, b in zip(got, expected):
                assert a.prompt_token_ids == b.prompt_token_ids
                assert all(x.pixel_values.equal(y.pixel_values) for x, y in zip(a.images, b.images))
    assert processor._idle.qsize() <= 4  # one HF processor per call at once, at most


# -- text alone: the tokenizer's own encode, the processor's ids ----------------------------------

TEXTS = ["hi", "  leading spaces and trailing  ", "Ünïcödé — “quotes” 中文 🙂", "line\nbreaks\n\n\ttabs",
         "</s><s> special-looking text", "a" * 3000]


@pytest.mark.parametrize("arch", ["llava", "llava-next", "qwen2-vl"])
def test_text_prompts_get_the_ids_the_hf_processor_gives(tiny_checkpoint, arch):
    from hydrad.models.hf_processor import load_hf_processor

    model_dir = tiny_checkpoint(arch)
    ours = InputProcessor(model_dir, max_images_per_request=4, max_image_pixels=10**8)
    hf = load_hf_processor(model_dir, ours.hf_config.model_type)
    for text in TEXTS:
        expected = hf(text=text, return_tensors="pt")["input_ids"][0].tolist()
        assert ours.process_prompt(text).prompt_token_ids == expected, text
    messages = [{"role": "user", "content": [{"type": "text", "text": TEXTS[2]}]}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.process_chat(messages).prompt_token_ids == hf(text=text, return_tensors="pt")["input_ids"][0].tolist()


def test_an_images_digest_is_its_files(processor):
    """Prefix caching matches images by a digest of the file sent (and the layout it gives):
    the same file in two requests, as a data URL or as fetched bytes, is one image; another file,
    even of the same pixels, is another; an image object is matched by its pixels."""
    from hydrad.images import EncodedImage, data_url_bytes

    def digest(source) -> bytes:
        prompt = processor.process_chat(user(source, {"type": "text", "text": "what is it?"}))
        (only,) = prompt.images
        return only.content_hash

    url = png_url(40, 30, seed=1)
    picture = Image.open(io.BytesIO(data_url_bytes(url))).convert("RGB")
    again = io.BytesIO()
    picture.save(again, "PNG", compress_level=1)  # the same pixels in another file
    other = "data:image/png;base64," + base64.b64encode(again.getvalue()).decode()
    data = data_url_bytes(url)
    fetched = {"type": "image", "image": EncodedImage(data, picture.size)}
    as_object = {"type": "image", "image": picture}

    first = digest(image(url))
    assert first is not None and len(first) == 16
    assert digest(image(url)) == first == digest(fetched)
    assert digest(image(other)) != first
    assert digest(image(png_url(40, 30, seed=2))) != first
    assert digest(as_object) == digest({"type": "image", "image": picture.copy()}) not in (None, first)


def test_a_requests_tools_reach_a_chat_template_that_renders_them(tiny_llava_dir, tmp_path):
    """The served families' templates have no place for tools (they are left out there); a
    checkpoint whose template renders them gets them in the prompt."""
    import shutil

    model_dir = tmp_path / "with-tools"
    shutil.copytree(tiny_llava_dir, model_dir)
    template = model_dir / "chat_template.jinja"
    template.write_text("{%- if tools %}TOOLS: {{ tools | map(attribute='function') | map(attribute='name') "
                        "| join(',') }}\n{% endif %}" + template.read_text())
    tools = [{"type": "function", "function": {"name": "lookup_weather"}}]
    messages = [{"role": "user", "content": "hi"}]
    ours = InputProcessor(model_dir, max_images_per_request=1, max_image_pixels=10**6)
    text = lambda ids: ours.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with_tools = ours.process_chat(messages, tools).prompt_token_ids
    assert text(with_tools) == "TOOLS: lookup_weather\n" + text(ours.process_chat(messages).prompt_token_ids)
    plain = InputProcessor(tiny_llava_dir, max_images_per_request=1, max_image_pixels=10**6)
    assert plain.process_chat(messages, tools).prompt_token_ids == plain.process_chat(messages).prompt_token_ids


# -- tools in the chat template ----------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "22 C"}]},
]


def test_tools_earlier_calls_and_their_results_go_in_a_template_with_tools(tiny_checkpoint):
    processor = InputProcessor(tiny_checkpoint("qwen2-vl"))
    assert processor.tool_call_format == "hermes"
    text = processor.tokenizer.decode(processor.process_chat(TOOL_TURNS, [WEATHER_TOOL]).prompt_token_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "weather"' in text
    assert "within <tool_call></tool_call> XML tags" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22 C\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in text
    # Without tools, the template writes what it always did.
    plain = processor.tokenizer.decode(processor.process_chat(TOOL_TURNS[:1]).prompt_token_ids)
    assert plain == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                     "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("change, error, param", [
    ({"function": {"name": "weather", "arguments": "city=Paris"}}, "must be a JSON object (as a string)",
     "messages[1].tool_calls[0].function.arguments"),
    ({"function": {"name": "weather", "arguments": {"city": "Paris"}}}, 'must be {"type": "function"',
     "messages[1].tool_calls[0]"),
])
def test_bad_earlier_calls_are_refused_by_name(tiny_checkpoint, change, error, param):
    processor = InputProcessor(tiny_checkpoint("qwen2-vl"))
    turns = [TOOL_TURNS[0], {**TOOL_TURNS[1], "tool_calls": [{**TOOL_TURNS[1]["tool_calls"][0], **change}]}]
    with pytest.raises(RequestError) as info:
        processor.process_chat(turns, [WEATHER_TOOL])
    assert error in str(info.value) and info.value.param == param
    with pytest.raises(RequestError, match="text parts") as info:
        processor.process_chat([TOOL_TURNS[0], {"role": "tool", "content": [image(png_url(4, 4))]}])
    assert info.value.param == "messages[1].content"


def test_a_chat_template_of_ones_own(tiny_llava_dir, tmp_path):
    from hydrad.config import ModelConfig
    from hydrad.errors import ConfigError
    from hydrad.models.chat_templates import QWEN2_VL_CHAT_TEMPLATE

    assert InputProcessor(tiny_llava_dir).tool_call_format is None
    path = tmp_path / "tools.jinja"
    path.write_text(QWEN2_VL_CHAT_TEMPLATE)
    processor = InputProcessor(tiny_llava_dir, chat_template=path)
    assert processor.tool_call_format == "hermes"
    text = processor.tokenizer.decode(processor.process_chat(TOOL_TURNS, [WEATHER_TOOL]).prompt_token_ids)
    assert "<|im_start|>" in text and "<tool_response>" in text  # the file's template, not LLaVA's
    assert ModelConfig(chat_template=str(path)).chat_template == str(path)
    with pytest.raises(ConfigError, match="model.chat_template: no such file"):
        ModelConfig(chat_template=str(tmp_path / "missing.jinja"))
    # A template's own refusal is the request's error, in one line.
    path.write_text("{{ raise_exception('no tool turns here') }}")
    with pytest.raises(RequestError, match="the model's chat template refused the messages: no tool turns here"):
        InputProcessor(tiny_llava_dir, chat_template=path).process_chat(TOOL_TURNS[:1])


def test_tool_call_tags_that_are_special_tokens_stay_in_the_answer(tiny_checkpoint, tmp_path):
    import asyncio
    import shutil
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from hydrad.server.engine_client import EngineClient
    from hydrad.server.protocol import parse_chat_request

    assert not InputProcessor(tiny_checkpoint("qwen2-vl")).tool_call_tags_special
    path = shutil.copytree(tiny_checkpoint("qwen2-vl"), tmp_path / "special-tags")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tokenizer.save_pretrained(path)
    processor = InputProcessor(path)
    assert processor.tool_call_tags_special

    def prepared(body: dict) -> dict:
        """The sampling fields the daemon prepares a chat with."""
        seen = {}

        async def prepare(req_id, size, reservation, arrival, process, options, param, price_once=False):
            seen.update(options.params)

        client = SimpleNamespace(processor=processor, http_session=None, _prepare=prepare)
        client._inspect_chat = lambda messages, template: EngineClient._inspect_chat(client, messages, template)
        asyncio.run(EngineClient.prepare_chat(client, "r", parse_chat_request(body), None, 0.0))
        return seen

    tools = {"messages": TOOL_TURNS[:1], "tools": [WEATHER_TOOL]}
    assert prepared(tools)["skip_special_tokens"] is False  # "auto": the tags stay in the text
    assert prepared({**tools, "skip_special_tokens": True})["skip_special_tokens"] is True  # as asked
    assert "skip_special_tokens" not in prepared({**tools, "tool_choice": "none"})


@pytest.mark.parametrize("arch", ["llava", "qwen2-vl"])
def test_prompts_of_token_ids(tiny_checkpoint, arch):
    """A prompt of token ids is taken as it is; ids past the vocabulary and image or video
    placeholders (which would need an image's embeddings) are refused by name."""
    processor = InputProcessor(tiny_checkpoint(arch))
    ids = processor.process_prompt("a short prompt").prompt_token_ids
    assert processor.process_prompt(ids).prompt_token_ids == ids
    assert processor.prompt_text(ids) == processor.tokenizer.decode(ids)
    assert processor.process_prompt(ids).mrope_positions is None  # text only: the flat positions
    vocab_size = processor.hf_config.text_config.vocab_size
    placeholders = [t for t in (processor.image_token_id, processor.video_token_id) if t is not None]
    cases = [([vocab_size], "outside the model's vocabulary"), ([-1], "outside the model's vocabulary"),
             ([], "at least one"), ([0] * (processor.max_model_len + 1), "maximum context length")]
    for bad, error in cases + [([0, t], "placeholder tokens") for t in placeholders]:
        with pytest.raises(RequestError, match=error) as info:
            processor.process_prompt(bad)
        assert info.value.param == "prompt"
    if processor.video_token_id is not None:  # the same placeholder in a text prompt
        with pytest.raises(RequestError, match="video placeholder tokens but no video") as info:
            processor.process_prompt("a <|vision_start|><|video_pad|><|vision_end|> here")
        assert info.value.param == "prompt"


# -- the chat template's options (vLLM's add_generation_prompt, continue_final_message,
# chat_template_kwargs) ----------------------------------------------------------------------------

BEGUN = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
         {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]}]


@pytest.mark.parametrize("arch", ["llava", "qwen2-vl"])
def test_the_template_options_give_the_ids_the_hf_processor_gives(tiny_checkpoint, arch):
    from hydrad.chat_options import ChatTemplateOptions
    from hydrad.models.hf_processor import load_hf_processor

    model_dir = tiny_checkpoint(arch)
    ours = InputProcessor(model_dir, max_images_per_request=4, max_image_pixels=10**8)
    hf = load_hf_processor(model_dir, ours.hf_config.model_type)

    def hf_ids(messages, **options):
        return hf(text=hf.apply_chat_template(messages, tokenize=False, **options), return_tensors="pt")[
            "input_ids"][0].tolist()

    continued = ours.process_chat(BEGUN, options=ChatTemplateOptions.of(continue_final_message=True))
    assert continued.prompt_token_ids == hf_ids(BEGUN, continue_final_message=True)
    # The answer begun is the prompt's end: no end of turn after it, no new header.
    assert ours.tokenizer.decode(continued.prompt_token_ids).rstrip().endswith("The colour is")
    plain = ours.process_chat(BEGUN[:1], options=ChatTemplateOptions.of(add_generation_prompt=False))
    assert plain.prompt_token_ids == hf_ids(BEGUN[:1], add_generation_prompt=False)
    assert plain.prompt_token_ids != ours.process_chat(BEGUN[:1]).prompt_token_ids  # the default adds the header


def test_the_templates_own_variables_reach_it_and_others_are_left_out(tiny_llava_dir, tmp_path):
    from hydrad.chat_options import ChatTemplateOptions

    path = tmp_path / "thinking.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'][0]['text'] }}\n{% endfor %}"
                    "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}")
    processor = InputProcessor(tiny_llava_dir, chat_template=path)

    def text(**kwargs):
        options = ChatTemplateOptions.of(kwargs=kwargs)
        return processor.tokenizer.decode(processor.process_chat(BEGUN[:1], options=options).prompt_token_ids)

    assert "<think>" in text(enable_thinking=True) and "<think>" not in text(enable_thinking=False)
    assert text(unknown_to_it=1) == text()  # a variable this template does not read: left out


@pytest.mark.parametrize("options, messages, error, param", [
    (dict(add_generation_prompt=True, continue_final_message=True), BEGUN, "cannot both be true",
     "continue_final_message"),
    (dict(continue_final_message=True), BEGUN[:1], "the last message to be the assistant's", "messages"),
    (dict(kwargs={"messages": []}), BEGUN[:1], "may not set messages", "chat_template_kwargs"),
    (dict(kwargs={"add_generation_prompt": False}), BEGUN[:1], "may not set add_generation_prompt",
     "chat_template_kwargs"),
])
def test_template_options_that_cannot_hold_are_refused_by_name(processor, options, messages, error, param):
    from hydrad.chat_options import ChatTemplateOptions

    with pytest.raises(RequestError, match=error) as caught:
        processor.process_chat(messages, options=ChatTemplateOptions.of(**options))
    assert caught.value.param == param


def test_template_variables_count_against_the_prompts_bound(tiny_llava_dir):
    from hydrad.chat_options import ChatTemplateOptions

    small = InputProcessor(tiny_llava_dir, max_model_len=64)
    options = ChatTemplateOptions.of(kwargs={"notes": "x" * 5000})
    assert options.num_chars == len('{"notes": ""}') + 5000
    with pytest.raises(RequestError, match="maximum context length is 64 tokens") as caught:
        small.inspect_chat(BEGUN[:1], options)
    assert caught.value.param == "messages"
    small.inspect_chat(BEGUN[:1])  # the messages alone fit


def test_a_placeholder_is_repeated_after_tokenizing_only_where_the_tokenizer_keeps_it_whole():
    """An added token stays whole beside any text: its ids are repeated after tokenizing. A
    placeholder the tokenizer merges with its repeats ("ab" + "ab" is one piece) is repeated
    in the text first, as transformers' processors do."""
    from tokenizers import AddedToken

    from hydrad.processor import _placeholder_is_atomic

    added = tokenizer_with()
    added.add_special_tokens([AddedToken("<image>", special=True)])
    assert _placeholder_is_atomic(Backend(added), "<image>", added.token_to_id("<image>"))
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({"ab": len(vocab), "abab": len(vocab) + 1})
    merging = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")]))
    merging.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert not _placeholder_is_atomic(Backend(merging), "ab", vocab["ab"])


def test_both_ways_of_placing_image_tokens_give_one_prompt(processor):
    """Tokenized with one placeholder per image and repeated after, or repeated first: the same
    ids and image offsets (the first is every served family's: test_image_processing checks
    it against transformers' processors)."""
    messages = user(image(png_url(40, 30, 1)), {"type": "text", "text": "and"}, image(png_url(30, 40, 2)),
                    {"type": "text", "text": "x <image"})
    beyond = user(image(png_url(40, 30, 1)), {"type": "text", "text": "x <image>"})  # a placeholder too many
    assert processor.expands_image_ids
    expanded = processor.process_chat(messages)
    with pytest.raises(RequestError, match="placeholder tokens beyond its images"):
        processor.process_chat(beyond)
    processor.expands_image_ids = False
    try:
        repeated = processor.process_chat(messages)
        with pytest.raises(RequestError, match="placeholder tokens beyond its images"):
            processor.process_chat(beyond)
    finally:
        processor.expands_image_ids = True
    assert expanded.prompt_token_ids == repeated.prompt_token_ids
    assert [i.offset for i in expanded.images] == [i.offset for i in repeated.images]
