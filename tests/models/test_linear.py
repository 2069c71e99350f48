"""Linear layers packed for oneDNN on a CPU, and the SDPA backend's block gather."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hydrad.models.attention.sdpa import gather_blocks
from hydrad.models.linear import ENV_SWITCH, PackedLinear, pack_linears, packing_supported

needs_packing = pytest.mark.skipif(not packing_supported("cpu", torch.float32), reason="torch without oneDNN")


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 16, 300])
def test_packed_linear_computes_what_the_plain_one_does(rows, bias, dtype):
    torch.manual_seed(rows)
    plain = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear(plain)
    assert packed.packed_weight.dtype == dtype
    # bfloat16 keeps 8 bits of mantissa: the two may round a sum's last bit apart
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for x in (torch.randn(rows, 96), torch.randn(2, rows, 96), torch.randn(96, rows).t()):
        x = x.to(dtype)
        with torch.inference_mode():
            got = packed(x)
            assert got.dtype == dtype
            torch.testing.assert_close(got, F.linear(x, plain.weight, plain.bias), atol=tol, rtol=tol)


@needs_packing
def test_a_packed_layer_frees_its_plain_weight_and_keeps_its_shape():
    packed = PackedLinear(nn.Linear(32, 48))
    assert [name for name, _ in packed.named_parameters()] == []
    assert packed.weight.device.type == "meta"
    assert packed.weight.shape == (48, 32) and packed.weight.dtype == torch.float32
    with pytest.raises((NotImplementedError, RuntimeError)):
        packed.weight.sum().item()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 4, bias=False)


@needs_packing
def test_pack_linears_replaces_every_linear_of_the_parts_named():
    model = _Block()
    x = torch.randn(5, 8)
    with torch.inference_mode():
        before = model.head(model.mlp(model.proj(x)))
    assert pack_linears(model, ["proj", "mlp"], "cpu", torch.float32) == 3
    assert isinstance(model.head, nn.Linear) and not isinstance(model.head, PackedLinear)
    assert pack_linears(model, ["head"], "cpu", torch.float32) == 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.inference_mode():
        torch.testing.assert_close(model.head(model.mlp(model.proj(x))), before, atol=1e-5, rtol=1e-5)


@needs_packing
def test_pack_linears_packs_bfloat16_where_onednn_has_bfloat16_kernels():
    # Packing runs oneDNN's bfloat16 reorder, which needs the kernels (AVX-512 bfloat16, or
    # Arm's); the choice without them is the next test's, on any CPU.
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 kernels for this CPU")
    assert packing_supported("cpu", torch.bfloat16)
    model = _Block().to(torch.bfloat16)
    assert pack_linears(model, ["proj", "mlp", "head"], "cpu", torch.bfloat16) == 4
    assert not any(type(m) is nn.Linear for m in model.modules())


@needs_packing
def test_pack_linears_leaves_bfloat16_alone_without_onednn_bfloat16_kernels(monkeypatch):
    # A CPU without them: float32 is still packed, bfloat16 runs the plain layers.
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert packing_supported("cpu", torch.float32) and not packing_supported("cpu", torch.bfloat16)
    assert pack_linears(_Block().to(torch.bfloat16), ["proj", "mlp", "head"], "cpu", torch.bfloat16) == 0


def test_pack_linears_leaves_other_devices_dtypes_and_the_switched_off_alone(monkeypatch):
    model = _Block()
    assert pack_linears(model, ["proj", "mlp", "head"], "cuda", torch.float32) == 0
    assert pack_linears(model.to(torch.float16), ["proj", "mlp", "head"], "cpu", torch.float16) == 0
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert pack_linears(_Block(), ["proj", "mlp", "head"], "cpu", torch.float32) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@needs_packing
def test_a_loaded_cpu_model_runs_only_packed_linear_layers():
    from test_llava_model import canonical_weights, make_config, make_pair

    from hydrad.models.llava import LlavaForConditionalGeneration

    hf, ours = make_pair(make_config())
    assert not any(type(m) is nn.Linear or type(m).__name__ == "MergedLinear" for m in ours.modules())
    assert sum(isinstance(m, PackedLinear) for m in ours.modules()) > 0
    language_only = LlavaForConditionalGeneration(make_config(), load_vision=False)
    language_only.load_weights(canonical_weights(hf).items())
    # A part added later is packed when its weights arrive, and only then.
    language_only.add_parts(vision=True)
    assert any(type(m) is nn.Linear for m in language_only.vision_tower.modules())
    language_only.load_weights(canonical_weights(hf).items(), vision=True)
    assert not any(type(m) is nn.Linear for m in language_only.modules())


@pytest.mark.parametrize("block_ids", [[3, 0, 7], [5], [1, 1, 6, 2]])
def test_gather_blocks_reads_the_blocks_in_order(block_ids):
    # [2, num_blocks, block_size, num_kv_heads, head_dim]
    pool = torch.randn(2, 8, 4, 2, 3)
    ids = torch.tensor(block_ids)
    keys, values = gather_blocks(pool, ids)
    assert keys.shape == values.shape == (4 * len(block_ids), 2, 3)
    torch.testing.assert_close(keys, torch.cat([pool[0, b] for b in block_ids]), atol=0, rtol=0)
    torch.testing.assert_close(values, torch.cat([pool[1, b] for b in block_ids]), atol=0, rtol=0)
