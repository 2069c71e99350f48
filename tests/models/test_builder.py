"""The offline checkpoint builder, the default model and ``hydrad make-model``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import load_file

from factories import make_tiny_llava, weight_files
from hydrad.cli.hydrad_main import cli
from hydrad.errors import CheckpointError
from hydrad.models.builder import build_model
from hydrad.models.default import default_model_path, resolve_model_path

TINY_IMAGE_TOKENS = (56 // 14) ** 2


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return {name: t for file in weight_files(path) for name, t in load_file(file).items()}


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


def _user_turn(text: str, num_images: int) -> dict:
    return {"role": "user", "content": [*({"type": "image"} for _ in range(num_images)), {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def tiny_processor(tiny_llava_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_llava_dir)


@pytest.fixture(scope="module")
def tiny_model(tiny_llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir).eval()


def test_tiny_folder_is_complete_and_under_1mb(tiny_llava_dir):
    names = {p.name for p in tiny_llava_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "processor_config.json", "chat_template.jinja"} <= names
    assert not any(name.endswith(".tmp") for name in os.listdir(tiny_llava_dir.parent))
    assert _folder_bytes(tiny_llava_dir) < 1_000_000


def test_tiny_loads_in_transformers(tiny_llava_dir, tiny_model, tiny_processor):
    from transformers import AutoTokenizer, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    config = tiny_model.config
    assert isinstance(tiny_processor, LlavaProcessor)
    assert config.text_config.vocab_size == len(tokenizer) > 256
    assert config.image_token_index == tokenizer.convert_tokens_to_ids("<image>")
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token, tokenizer.pad_token) == (
        "<s>", "</s>", "<unk>", "<pad>")
    assert config.text_config.eos_token_id == tokenizer.eos_token_id
    assert config.image_seq_length == TINY_IMAGE_TOKENS
    assert tokenizer("a red bicycle").input_ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(tokenizer("a red bicycle", add_special_tokens=False).input_ids) == "a red bicycle"
    assert tokenizer.chat_template == tiny_processor.chat_template


@pytest.mark.parametrize("num_images", [1, 2])
def test_processor_expands_each_image_to_its_tokens(tiny_model, tiny_processor, num_images):
    prompt = tiny_processor.apply_chat_template([_user_turn("What is shown?", num_images)], add_generation_prompt=True)
    images = [Image.new("RGB", (80 + 10 * i, 60), (200, 30 * i, 40)) for i in range(num_images)]
    inputs = tiny_processor(text=prompt, images=images, return_tensors="pt")
    num_placeholders = (inputs.input_ids == tiny_model.config.image_token_index).sum().item()
    assert num_placeholders == num_images * TINY_IMAGE_TOKENS
    assert tuple(inputs.pixel_values.shape) == (num_images, 3, 56, 56)
    with torch.no_grad():
        logits = tiny_model(**inputs).logits
    assert logits.shape[-1] == tiny_model.config.text_config.vocab_size


def test_greedy_generation_is_varied(tiny_model, tiny_processor):
    prompt = tiny_processor.apply_chat_template([_user_turn("What is in the picture?", 1)], add_generation_prompt=True)
    inputs = tiny_processor(text=prompt, images=[Image.new("RGB", (80, 60), (200, 30, 40))], return_tensors="pt")
    out = tiny_model.generate(**inputs, do_sample=False, max_new_tokens=32, output_scores=True,
                              return_dict_in_generate=True)
    new_ids = out.sequences[0, inputs.input_ids.shape[1]:].tolist()
    assert len(set(new_ids)) >= 8, new_ids
    # Top-1 must win clearly, or another implementation's rounding could pick a different token.
    margins = [scores[0].topk(2).values for scores in out.scores]
    assert min((top[0] - top[1]).item() for top in margins) > 1e-5


def test_same_seed_same_weights_other_seed_different(tmp_path, tiny_llava_dir):
    reference = _weights(tiny_llava_dir)
    same = _weights(make_tiny_llava(tmp_path / "seed0", seed=0))
    other = _weights(make_tiny_llava(tmp_path / "seed1", seed=1))
    assert same.keys() == reference.keys() == other.keys()
    assert all(torch.equal(same[name], t) for name, t in reference.items())
    # Norm weights start at ones and biases at zeros whatever the seed; every matrix must differ.
    matrices = [name for name, t in reference.items() if t.dim() >= 2]
    assert matrices and all(not torch.equal(other[name], reference[name]) for name in matrices)


def test_build_refuses_non_empty_folder_unless_overwrite(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=re.escape(f"{out} already exists and is not empty")):
        build_model(out, size="tiny", progress=False)
    assert (out / "notes.txt").exists()
    build_model(out, size="tiny", seed=2, overwrite=True, progress=False)
    assert not (out / "notes.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_off_a_terminal_the_build_says_each_step_on_a_line_of_its_own(tmp_path, capsys):
    """Under a pipe, a file or the journal (the console is not a terminal here) a progress bar
    would leave only an empty line: each step is a line instead, and the end one more."""
    build_model(tmp_path / "m", size="tiny", progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:4] == [f"building llava tiny (seed 0): {step} ({i}/4)" for i, step in enumerate(
        ("training the tokenizer", "initialising weights", "writing weights",
         "writing the tokenizer and processor"), 1)]
    assert re.fullmatch(r"building llava tiny \(seed 0\): done in [0-9.]+ s", lines[4]) and len(lines) == 5


@pytest.mark.parametrize(("arch", "size", "message"), [("qwen3-vl", "tiny", "architecture 'qwen3-vl'"),
                                                        ("llava", "huge", "size 'huge'")])
def test_build_rejects_unknown_arch_and_size(tmp_path, arch, size, message):
    with pytest.raises(CheckpointError, match=message):
        build_model(tmp_path / "m", arch, size, progress=False)


def test_make_model_cli(tmp_path, tiny_llava_dir):
    out = tmp_path / "cli-model"
    runner = CliRunner()
    result = runner.invoke(cli, ["make-model", str(out), "--arch", "llava", "--size", "tiny", "--seed", "0"])
    assert result.exit_code == 0, result.output
    weights = _weights(out)
    assert all(torch.equal(weights[name], t) for name, t in _weights(tiny_llava_dir).items())

    refused = runner.invoke(cli, ["make-model", str(out), "--size", "tiny", "--seed", "1"])
    assert refused.exit_code == 1
    assert refused.output.strip().splitlines() == [f"Error: {out} is not empty; pass --force to replace it"]

    forced = runner.invoke(cli, ["make-model", str(out), "--size", "tiny", "--seed", "1", "--force"])
    assert forced.exit_code == 0, forced.output
    assert not torch.equal(_weights(out)["multi_modal_projector.linear_1.weight"],
                           weights["multi_modal_projector.linear_1.weight"])


@pytest.fixture(scope="module")
def tokenizer(tiny_llava_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llava_dir)


def _render(tokenizer, messages, add_generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_chat_template_string_content(tokenizer):
    assert _render(tokenizer, [{"role": "user", "content": "Hello there"}]) == "USER: Hello there ASSISTANT:"
    assert _render(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=False) == "USER: Hi "


def test_chat_template_parts_put_images_first(tokenizer):
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image", "image": "cat.png"},
        {"type": "text", "text": "these two."},
        {"type": "image"},
    ]
    rendered = _render(tokenizer, [{"role": "user", "content": content}])
    assert rendered == "USER: <image>\n<image>\n<image>\nCompare these two. ASSISTANT:"


def test_chat_template_multi_turn_with_system(tokenizer, tiny_processor):
    messages = [
        {"role": "system", "content": "You describe images."},
        _user_turn("What is it?", 1),
        {"role": "assistant", "content": [{"type": "text", "text": "A dog."}]},
        {"role": "user", "content": "What colour?"},
        {"role": "assistant", "content": "Brown."},
        {"role": "user", "content": "Thanks."},
    ]
    expected = ("You describe images. USER: <image>\nWhat is it? ASSISTANT: A dog.</s>"
                "USER: What colour? ASSISTANT: Brown.</s>USER: Thanks. ASSISTANT:")
    assert _render(tokenizer, messages) == expected
    assert tiny_processor.apply_chat_template(messages, add_generation_prompt=True) == expected
    assert tokenizer(expected).input_ids.count(tokenizer.eos_token_id) == 2


def test_chat_template_rejects_unknown_role(tokenizer):
    with pytest.raises(Exception, match="unsupported role: tool"):
        _render(tokenizer, [{"role": "tool", "content": "42"}])


@pytest.fixture(scope="module")
def default_model_dir(hydrad_cache_dir):
    return default_model_path()


def test_default_model_is_small_llava_in_cache(default_model_dir, hydrad_cache_dir):
    from transformers import AutoConfig, AutoProcessor

    assert default_model_dir.parent.parent == hydrad_cache_dir
    config = AutoConfig.from_pretrained(default_model_dir)
    vision, text = config.vision_config, config.text_config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.image_size, vision.patch_size) == (256, 4, 224, 14)
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.head_dim,
            text.num_key_value_heads, text.max_position_embeddings) == (512, 8, 8, 64, 2, 4096)
    processor = AutoProcessor.from_pretrained(default_model_dir)
    assert text.vocab_size == len(processor.tokenizer) >= 4096
    prompt = processor.apply_chat_template([_user_turn("Describe.", 1)], add_generation_prompt=True)
    inputs = processor(text=prompt, images=[Image.new("RGB", (300, 200))], return_tensors="pt")
    assert (inputs.input_ids == config.image_token_index).sum().item() == (224 // 14) ** 2


def test_default_model_is_built_once(default_model_dir):
    config_file = default_model_dir / "config.json"
    before = config_file.stat().st_mtime_ns
    assert resolve_model_path(None) == default_model_dir
    assert config_file.stat().st_mtime_ns == before
    assert json.loads(config_file.read_text())["model_type"] == "llava"


def test_resolve_model_path(tmp_path, tiny_llava_dir):
    assert resolve_model_path(str(tiny_llava_dir)) == tiny_llava_dir
    with pytest.raises(CheckpointError, match=re.escape(f"model folder {tmp_path / 'missing'} does not exist")):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is not a folder"):
        resolve_model_path(str(tmp_path / "file"))


def test_failed_publish_names_its_cause_and_leaves_nothing(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    out = tmp_path / "model"
    with pytest.raises(CheckpointError, match=re.escape(f"cannot move the built model into {out}: Permission denied")):
        build_model(out, "llava", "tiny", progress=False)
    assert list(tmp_path.iterdir()) == []


ARCHITECTURES = {
    "llava": "LlavaForConditionalGeneration",
    "llava-next": "LlavaNextForConditionalGeneration",
    "qwen2-vl": "Qwen2VLForConditionalGeneration",
    "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
}
# Head sizes vLLM's CPU attention supports: the small models must run there too.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128)


def test_every_architecture_is_buildable():
    from hydrad.models.builder import ARCHS

    assert set(ARCHS) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tiny_checkpoint_of_every_arch_loads_in_transformers(tiny_checkpoint, arch):
    from transformers import AutoTokenizer

    from factories import hf_model
    from hydrad.models.hf_processor import load_hf_processor

    path = tiny_checkpoint(arch)
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == [ARCHITECTURES[arch]]
    assert _folder_bytes(path) < 1_200_000
    model = hf_model(path)
    assert type(model).__name__ == ARCHITECTURES[arch]
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 400_000
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.text_config.vocab_size == len(tokenizer)
    processor = load_hf_processor(path, raw["model_type"])
    # The folder names transformers' own processor class, as a hub checkpoint does.
    assert json.loads((path / "processor_config.json").read_text())["processor_class"] in (
        "LlavaProcessor", "LlavaNextProcessor", "Qwen2VLProcessor", "Qwen2_5_VLProcessor")
    prompt = processor.apply_chat_template([_user_turn("What is shown?", 2)], add_generation_prompt=True)
    images = [Image.new("RGB", (90, 60), (200, 30, 40)), Image.new("RGB", (40, 100), (20, 30, 240))]
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[-1] == len(tokenizer)


@pytest.mark.parametrize("arch", ["qwen2-vl", "qwen2.5-vl"])
def test_qwen_folders_name_the_video_processor_their_processor_requires(tiny_checkpoint, arch):
    """transformers' Qwen2-VL / Qwen2.5-VL processor requires a video processor (built where
    torchvision is installed, as in other servers' environments): the folder configures one as
    its image processor is configured, and hydrad, which serves images only, ignores it."""
    from hydrad.models.hf_processor import load_hf_processor

    path = tiny_checkpoint(arch)
    config = json.loads((path / "processor_config.json").read_text())
    video, image = config["video_processor"], config["image_processor"]
    assert video["video_processor_type"] == "Qwen2VLVideoProcessor"
    for key in ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std"):
        assert video[key] == image[key], key
    processor = load_hf_processor(path, json.loads((path / "config.json").read_text())["model_type"])
    assert getattr(processor, "video_processor", None) is None
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_hf5_layout_is_what_transformers_saves(tmp_path, tiny_checkpoint, arch):
    from factories import hf_model

    hf_model(tiny_checkpoint(arch)).save_pretrained(tmp_path / "saved")
    assert _weights(tmp_path / "saved").keys() == _weights(tiny_checkpoint(arch, "hf5")).keys()


def test_hub_layouts(tiny_checkpoint):
    next_names = _weights(tiny_checkpoint("llava-next", "hub")).keys()
    assert "image_newline" in next_names
    assert any(n.startswith("vision_tower.vision_model.encoder.") for n in next_names)
    assert any(n.startswith("language_model.model.layers.") for n in next_names)
    # The Qwen hub checkpoints name the weights as transformers 5 saves them.
    qwen_names = _weights(tiny_checkpoint("qwen2-vl", "hub")).keys()
    assert qwen_names == _weights(tiny_checkpoint("qwen2-vl", "hf5")).keys()
    assert {n.split(".")[0] for n in qwen_names} == {"model", "visual", "lm_head"}
    assert "model.layers.0.self_attn.q_proj.bias" in qwen_names and "visual.merger.mlp.0.weight" in qwen_names


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_small_configs_suit_cpu_benchmarks(arch):
    from hydrad.models.builder import train_tokenizer
    from hydrad.models.builder_archs import ARCH_SPECS, make_config

    spec = ARCH_SPECS[arch]
    assert spec.sizes["small"].vocab_size == 4096
    config = make_config(arch, "small", train_tokenizer(512, spec.tokenizer))
    text = config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert head_dim in CPU_HEAD_DIMS
    assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads) == (512, 8, 2)
    if arch.startswith("qwen"):
        assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2


def test_make_model_cli_arch_and_layout(tmp_path, tiny_checkpoint):
    out = tmp_path / "qwen"
    result = CliRunner().invoke(cli, ["make-model", str(out), "--arch", "qwen2.5-vl", "--layout", "hub"])
    assert result.exit_code == 0, result.output
    assert "qwen2.5-vl tiny (seed 0, hub layout)" in result.output
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    weights = _weights(out)
    assert all(torch.equal(weights[name], t) for name, t in _weights(tiny_checkpoint("qwen2.5-vl", "hub")).items())
    refused = CliRunner().invoke(cli, ["make-model", str(tmp_path / "x"), "--layout", "module"])
    assert refused.exit_code == 2 and "Invalid value for '--layout'" in refused.output
