"""The checkpoint loader: every weight layout under canonical names, dtypes, prefixes, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from factories import LAYOUTS, copy_without_weights, make_layout, module_state_dict, weight_files
from hydrad.errors import CheckpointError
from hydrad.models.loader import canonical_name, iter_weights, load_config

# The canonical-name contract, written out independently of the loader's rules.
_LAYER = r"language_model\.layers\.\d+\."
CANONICAL = re.compile(
    "|".join([
        r"language_model\.embed_tokens\.weight",
        _LAYER + r"self_attn\.[qkvo]_proj\.(weight|bias)",
        _LAYER + r"mlp\.(gate|up|down)_proj\.weight",
        _LAYER + r"(input_layernorm|post_attention_layernorm)\.weight",
        r"language_model\.norm\.weight",
        r"lm_head\.weight",
        r"vision_tower\.(embeddings|pre_layrnorm|encoder\.layers\.\d+|post_layernorm)\.[\w.]+",
        r"multi_modal_projector\.linear_[12]\.(weight|bias)",
    ])
)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")
LANGUAGE_PREFIXES = ("language_model.", "lm_head.")


@pytest.fixture(scope="module")
def reference(tiny_llava_dir) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict, without the leading ``model.``."""
    return {name.removeprefix("model."): t for name, t in module_state_dict(tiny_llava_dir).items()}


def _load(path: Path, dtype=torch.float32, prefixes=None) -> dict[str, torch.Tensor]:
    loaded = {}
    for name, tensor in iter_weights(path, dtype, prefixes):
        assert name not in loaded, f"{name} yielded twice"
        loaded[name] = tensor
    return loaded


def _assert_equal(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def test_layouts_are_distinct_on_disk(tiny_llava_layouts):
    from safetensors import safe_open

    assert set(tiny_llava_layouts) == set(LAYOUTS)
    first_names = {}
    for name, path in tiny_llava_layouts.items():
        with safe_open(weight_files(path)[0], framework="pt") as f:
            first_names[name] = set(f.keys())
    assert any(n.startswith("vision_tower.vision_model.") for n in first_names["hub"])
    assert any(n.startswith("vision_tower.encoder.") for n in first_names["hf5"])
    assert all(n.startswith(("model.", "lm_head.")) for n in first_names["module"])
    sharded = tiny_llava_layouts["hub-sharded"]
    assert len(weight_files(sharded)) >= 2 and (sharded / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_yields_canonical_module_weights(tiny_llava_layouts, reference, layout):
    loaded = _load(tiny_llava_layouts[layout])
    _assert_equal(loaded, reference)
    assert all(CANONICAL.fullmatch(name) for name in loaded), [n for n in loaded if not CANONICAL.fullmatch(n)]
    assert {"language_model.embed_tokens.weight", "lm_head.weight", "vision_tower.pre_layrnorm.weight",
            "vision_tower.encoder.layers.1.self_attn.q_proj.weight", "multi_modal_projector.linear_2.bias",
            "language_model.layers.1.self_attn.k_proj.weight", "language_model.norm.weight"} <= loaded.keys()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_fixtures_load_in_transformers(tiny_llava_layouts, tiny_llava_dir, layout):
    # Guards the fixtures themselves: each layout is one transformers reads as the same model.
    expected = module_state_dict(tiny_llava_dir)
    got = module_state_dict(tiny_llava_layouts[layout])
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], t) for name, t in expected.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_on_load(tiny_llava_layouts, reference, dtype):
    loaded = _load(tiny_llava_layouts["hub-sharded"], dtype)
    _assert_equal(loaded, {name: t.to(dtype) for name, t in reference.items()})


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_loads_as_float32(tmp_path, tiny_llava_dir, stored):
    state_dict = {name: t.to(stored) for name, t in module_state_dict(tiny_llava_dir).items()}
    path = make_layout(tiny_llava_dir, tmp_path / "half", state_dict, "hf5")
    expected = {name.removeprefix("model."): t.float() for name, t in state_dict.items()}
    _assert_equal(_load(path, torch.float32), expected)


@pytest.mark.parametrize("prefixes", [VISION_PREFIXES, LANGUAGE_PREFIXES, ("multi_modal_projector.",)])
def test_prefixes_select_weights(tiny_llava_layouts, reference, prefixes):
    loaded = _load(tiny_llava_layouts["hub-sharded"], prefixes=prefixes)
    _assert_equal(loaded, {name: t for name, t in reference.items() if name.startswith(prefixes)})


def test_prefixes_skip_shards_without_reading_them(tmp_path, tiny_llava_layouts, reference):
    path = tmp_path / "ckpt"
    copy_without_weights(tiny_llava_layouts["hub-sharded"], path)
    index_file = tiny_llava_layouts["hub-sharded"] / "model.safetensors.index.json"
    (path / index_file.name).write_text(index_file.read_text())
    weight_map = json.loads(index_file.read_text())["weight_map"]
    language_only = {
        shard for shard in set(weight_map.values())
        if all(canonical_name("llava", n).startswith(LANGUAGE_PREFIXES) for n, s in weight_map.items() if s == shard)
    }
    assert language_only, "the fixture should have a shard of language weights only"
    for file in weight_files(tiny_llava_layouts["hub-sharded"]):
        data = b"not a safetensors file" if file.name in language_only else file.read_bytes()
        (path / file.name).write_bytes(data)

    vision = _load(path, prefixes=VISION_PREFIXES)
    _assert_equal(vision, {name: t for name, t in reference.items() if name.startswith(VISION_PREFIXES)})
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        _load(path)


def test_tied_embeddings_yield_no_lm_head(tmp_path, tiny_llava_dir, reference):
    path = tmp_path / "tied"
    make_layout(tiny_llava_dir, path, module_state_dict(tiny_llava_dir), "hub")
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    loaded = _load(path)
    assert "lm_head.weight" not in loaded
    _assert_equal(loaded, {name: t for name, t in reference.items() if name != "lm_head.weight"})


def test_load_config(tiny_llava_dir):
    config = load_config(tiny_llava_dir)
    assert config.model_type == "llava"
    assert config.text_config.num_key_value_heads == 2
    assert config.vision_feature_layer == -2


def _with_config(tmp_path: Path, src: Path, **changes) -> Path:
    path = copy_without_weights(src, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


SUPPORTED = ("LlavaForConditionalGeneration, LlavaNextForConditionalGeneration, Qwen2VLForConditionalGeneration, "
             "Qwen2_5_VLForConditionalGeneration")


@pytest.mark.parametrize(
    ("changes", "bad"),
    [
        ({"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"]},
         "'Qwen3VLForConditionalGeneration'"),
        ({"model_type": "idefics3", "architectures": []}, "'idefics3'"),
        ({"architectures": ["LlavaLlamaForCausalLM"]}, "'LlavaLlamaForCausalLM'"),
        ({"model_type": "qwen2_vl", "architectures": ["Qwen2VLModel"]}, "'Qwen2VLModel'"),
    ],
)
def test_unsupported_architecture(tmp_path, tiny_llava_dir, changes, bad):
    path = _with_config(tmp_path, tiny_llava_dir, **changes)
    with pytest.raises(CheckpointError, match=re.escape(f"unsupported architecture {bad} (supported: {SUPPORTED})")):
        load_config(path)
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        _load(path)


def test_missing_folder_and_config(tmp_path, tiny_llava_dir):
    with pytest.raises(CheckpointError, match=re.escape(f"model folder {tmp_path / 'nope'} does not exist")):
        _load(tmp_path / "nope")
    path = copy_without_weights(tiny_llava_dir, tmp_path / "ckpt")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: no config.json")):
        load_config(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_config(path)


def test_no_weight_files(tmp_path, tiny_llava_dir):
    path = copy_without_weights(tiny_llava_dir, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: no weights (model.safetensors or")):
        _load(path)
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="found pytorch_model.bin .only safetensors is supported"):
        _load(path)


def test_index_naming_a_missing_shard(tmp_path, tiny_llava_layouts):
    src = tiny_llava_layouts["hub-sharded"]
    path = copy_without_weights(src, tmp_path / "ckpt")
    (path / "model.safetensors.index.json").write_text((src / "model.safetensors.index.json").read_text())
    shards = weight_files(src)
    for file in shards[:-1]:
        (path / file.name).write_bytes(file.read_bytes())
    with pytest.raises(CheckpointError, match=re.escape(f"names shard '{shards[-1].name}', which does not exist")):
        _load(path, prefixes=VISION_PREFIXES)


def test_unrecognised_tensor_name(tmp_path, tiny_llava_dir):
    state_dict = module_state_dict(tiny_llava_dir)
    path = make_layout(tiny_llava_dir, tmp_path / "ckpt", state_dict, "hf5")
    tensors = {name: t.contiguous() for name, t in state_dict.items()}
    tensors["text_model.encoder.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unrecognised tensor name 'text_model\.encoder\.weight'"):
        _load(path, prefixes=VISION_PREFIXES)


def test_canonical_name_drops_recomputed_buffers():
    assert canonical_name("llava", "language_model.model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert canonical_name("llava", "vision_tower.vision_model.embeddings.position_ids") is None
    assert canonical_name("llava", "vision_tower.vision_model.embeddings.position_embedding.weight") == (
        "vision_tower.embeddings.position_embedding.weight")
    assert canonical_name("qwen2_vl", "visual.rotary_pos_emb.inv_freq") is None


def test_canonical_name_of_transformers_4_module_names():
    # transformers 4 held the CLIP tower under vision_model; transformers 5 flattens it.
    assert canonical_name("llava", "model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") == (
        "vision_tower.encoder.layers.0.mlp.fc1.weight")
    assert canonical_name("llava", "model.vision_tower.post_layernorm.bias") == "vision_tower.post_layernorm.bias"


@pytest.mark.parametrize("weight_map", [["model-00001-of-00001.safetensors"], {"lm_head.weight": 3}])
def test_malformed_index_is_one_line_naming_it(tmp_path, tiny_llava_dir, weight_map):
    path = copy_without_weights(tiny_llava_dir, tmp_path / "ckpt")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not a safetensors index") as e:
        _load(path)
    assert "\n" not in str(e.value)


# In-memory module name -> canonical name for the newer families, written out independently of
# the loader's rules: the vision side under vision_tower. / multi_modal_projector., the decoder
# under language_model.
_MODULE_TO_CANONICAL = {
    "llava_next": ((r"^model\.image_newline$", "multi_modal_projector.image_newline"), (r"^model\.", "")),
    "qwen2_vl": ((r"^model\.visual\.", "vision_tower."), (r"^model\.language_model\.", "language_model.")),
}
_MODULE_TO_CANONICAL["qwen2_5_vl"] = _MODULE_TO_CANONICAL["qwen2_vl"]
NEW_ARCHS = {"llava-next": "llava_next", "qwen2-vl": "qwen2_vl", "qwen2.5-vl": "qwen2_5_vl"}


def _expected_canonical(model_type: str, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    expected = {}
    for name, tensor in state_dict.items():
        for pattern, replacement in _MODULE_TO_CANONICAL[model_type]:
            name, n = re.subn(pattern, replacement, name)
            if n:
                break
        expected[name] = tensor
    return expected


@pytest.fixture(scope="module")
def new_arch_references(tiny_checkpoint) -> dict[str, dict[str, torch.Tensor]]:
    return {arch: _expected_canonical(model_type, module_state_dict(tiny_checkpoint(arch)))
            for arch, model_type in NEW_ARCHS.items()}


@pytest.mark.parametrize("layout", ["hub", "hf5", "module", "hub-sharded"])
@pytest.mark.parametrize("arch", list(NEW_ARCHS))
def test_new_archs_every_layout_yields_canonical_weights(tmp_path, tiny_checkpoint, new_arch_references, arch, layout):
    if layout == "hub-sharded":
        src = tiny_checkpoint(arch)
        path = make_layout(src, tmp_path / "sharded", module_state_dict(src), "hub", 300_000, NEW_ARCHS[arch])
        assert len(weight_files(path)) >= 2
    else:
        path = tiny_checkpoint(arch, layout)
    loaded = _load(path)
    _assert_equal(loaded, new_arch_references[arch])
    vision = {n for n in loaded if n.startswith(VISION_PREFIXES)}
    language = {n for n in loaded if n.startswith(LANGUAGE_PREFIXES)}
    assert vision and language and vision | language == loaded.keys()
    assert "language_model.layers.1.self_attn.q_proj.weight" in loaded and "lm_head.weight" in loaded
    if arch == "llava-next":
        assert "multi_modal_projector.image_newline" in vision
    else:
        assert {"vision_tower.merger.mlp.2.weight", "language_model.layers.0.self_attn.v_proj.bias"} <= loaded.keys()


def test_tied_qwen_yields_no_lm_head(tmp_path, tiny_checkpoint, new_arch_references):
    # Qwen2-VL-2B ties its embeddings (and its checkpoint holds no lm_head).
    path = tmp_path / "tied"
    src = tiny_checkpoint("qwen2-vl")
    state_dict = {n: t for n, t in module_state_dict(src).items() if n != "lm_head.weight"}
    make_layout(src, path, state_dict, "hub", model_type="qwen2_vl")
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    reference = {n: t for n, t in new_arch_references["qwen2-vl"].items() if n != "lm_head.weight"}
    _assert_equal(_load(path), reference)


def test_new_archs_reject_names_of_another_family(tmp_path, tiny_checkpoint):
    # A LLaVA weight in a Qwen checkpoint names no Qwen module.
    src = tiny_checkpoint("qwen2-vl")
    state_dict = dict(module_state_dict(src), **{"multi_modal_projector.linear_1.weight": torch.zeros(2)})
    path = make_layout(src, tmp_path / "mixed", state_dict, "hub", model_type="qwen2_vl")
    with pytest.raises(CheckpointError, match="unrecognised tensor name 'multi_modal_projector.linear_1.weight'"):
        _load(path)
