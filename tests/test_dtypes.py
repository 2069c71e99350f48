"""What ``[model] dtype = "auto"`` resolves to: the device, the checkpoint's stored dtype and
whether the CPU has native bfloat16."""

from __future__ import annotations

import json

import pytest

from hydrad import dtypes
from hydrad.dtypes import cpu_flags, resolve_dtype_name, stored_dtype


def _config(path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llava", **fields}))
    return path


def test_the_stored_dtype_is_read_from_the_checkpoints_config(tmp_path):
    assert stored_dtype(_config(tmp_path / "a", dtype="bfloat16")) == "bfloat16"
    assert stored_dtype(_config(tmp_path / "b", torch_dtype="float16")) == "float16"
    assert stored_dtype(_config(tmp_path / "c", text_config={"torch_dtype": "bfloat16"})) == "bfloat16"
    assert stored_dtype(_config(tmp_path / "d", dtype="float32", text_config={"dtype": "bfloat16"})) == "float32"
    assert stored_dtype(_config(tmp_path / "e")) is None
    assert stored_dtype(_config(tmp_path / "f", dtype="int8")) is None
    assert stored_dtype(tmp_path / "missing") is None
    assert stored_dtype(None) is None
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "config.json").write_text("{not json")
    assert stored_dtype(tmp_path / "g") is None


def test_cpu_flags_read_x86_flags_and_arm_features():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n"
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert cpu_flags(arm) == {"fp", "asimd", "bf16", "i8mm"}
    assert cpu_flags("processor\t: 0\n") == frozenset()
    assert cpu_flags(x86) & dtypes.NATIVE_BFLOAT16_FLAGS and cpu_flags(arm) & dtypes.NATIVE_BFLOAT16_FLAGS
    assert not cpu_flags("flags\t: fpu avx2 avx512f\n") & dtypes.NATIVE_BFLOAT16_FLAGS


@pytest.mark.parametrize("stored, native, want", [
    ("float32", True, "float32"),
    (None, True, "float32"),
    ("bfloat16", True, "bfloat16"),
    ("float16", True, "bfloat16"),
    ("bfloat16", False, "float32"),
    ("float16", False, "float32"),
])
def test_auto_on_a_cpu_follows_the_checkpoint_where_the_cpu_computes_in_it(tmp_path, stored, native, want):
    model = _config(tmp_path, **({"dtype": stored} if stored else {}))
    assert resolve_dtype_name("auto", "cpu", model, native=native) == want


def test_auto_is_bfloat16_on_cuda_and_a_named_dtype_is_kept(tmp_path):
    model = _config(tmp_path, dtype="float32")
    assert resolve_dtype_name("auto", "cuda", model, native=False) == "bfloat16"
    for name in dtypes.DTYPE_NAMES:
        assert resolve_dtype_name(name, "cpu", model, native=False) == name
        assert resolve_dtype_name(name, "cuda", model) == name


def test_native_bfloat16_is_this_machines(monkeypatch, tmp_path):
    model = _config(tmp_path, dtype="bfloat16")
    for native in (True, False):
        monkeypatch.setattr(dtypes, "native_bfloat16", lambda native=native: native)
        assert resolve_dtype_name("auto", "cpu", model) == ("bfloat16" if native else "float32")
