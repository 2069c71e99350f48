"""What ``[model] dtype = "auto"`` runs a checkpoint in, decided without torch (the daemon's
preflight sizes the workers' weights by it before any worker loads).

On CUDA: bfloat16. On a CPU: the checkpoint's own precision where the CPU computes in it
at full speed. A checkpoint stored in float32 (or that does not say) runs in float32, and
greedy tokens equal transformers' in float32. One stored in half precision (bfloat16 or
float16, as published checkpoints mostly are) runs in bfloat16 where the CPU has native
bfloat16 dot products (x86's AVX512-BF16 or AMX-BF16, Arm's BF16), where oneDNN's bfloat16
matmuls run at about twice float32's speed; elsewhere bfloat16 is emulated, slower than
float32, and the checkpoint runs in float32. Naming a dtype overrides all of this.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

DTYPE_NAMES = ("float32", "bfloat16", "float16")
HALF = ("bfloat16", "float16")
# /proc/cpuinfo's flags (x86) or features (Arm) of native bfloat16 arithmetic
NATIVE_BFLOAT16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def stored_dtype(model_dir: str | os.PathLike | None) -> str | None:
    """The dtype a checkpoint's config.json says its weights are stored in (``dtype``, or
    the older ``torch_dtype``; at the top or in its ``text_config``), None where it names
    none or cannot be read."""
    if model_dir is None:
        return None
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    for section in (raw, raw.get("text_config")):
        if isinstance(section, dict):
            for key in ("dtype", "torch_dtype"):
                name = section.get(key)
                if isinstance(name, str) and name.removeprefix("torch.") in DTYPE_NAMES:
                    return name.removeprefix("torch.")
    return None


def cpu_flags(text: str) -> frozenset[str]:
    """The flags (x86) or features (Arm) of the first processor in /proc/cpuinfo's ``text``."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def native_bfloat16() -> bool:
    """Whether this machine's CPU has native bfloat16 dot products (False where unknown)."""
    try:
        return bool(cpu_flags(Path("/proc/cpuinfo").read_text()) & NATIVE_BFLOAT16_FLAGS)
    except OSError:
        return False


def resolve_dtype_name(name: str, device_type: str, model_dir: str | os.PathLike | None = None,
                       native: bool | None = None) -> str:
    """The dtype (a name of ``DTYPE_NAMES``) the configured ``name`` runs a checkpoint in on a
    device of ``device_type`` ("cpu", "cuda"); ``native``: whether the CPU has native
    bfloat16 (None: this machine's)."""
    if name != "auto":
        return name
    if device_type == "cuda":
        return "bfloat16"
    if stored_dtype(model_dir) in HALF and (native_bfloat16() if native is None else native):
        return "bfloat16"
    return "float32"
