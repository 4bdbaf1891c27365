"""AWQ and GPTQ checkpoints (4-bit, group 128): small random models quantized and packed by the
tests in each format's own layout (tests/quant_models.py, independent of the loader's
unpacking) match transformers on the dequantized fp32 weights token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance import Engine, SamplingParams
from appliance.config import ConfigError, load_config
from appliance.layers.linear import MatmulWeight
from tests.quant_models import greedy, random_llama, random_prompts, write_awq_or_gptq


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from appliance.models.demo_model import build_demo_model

    return build_demo_model("tiny", tmp_path_factory.mktemp("tiny-tok"))


def _engine(path: Path) -> Engine:
    # float32 activations: the exact reference's arithmetic (int8, the default, rounds them).
    return Engine(
        load_config(
            None,
            {
                "model.path": str(path),
                "model.dtype": "float32",
                "cache.kv_cache_memory": 0.1,
                "cache.swap_space": 0.0,
                "hardware.device": "cpu",
                "model.cpu_quant_activations": "float32",
            },
        )
    )


@pytest.mark.parametrize("kind", ["awq", "gptq"])
def test_packed_checkpoint_matches_its_dequantized_reference(
    kind: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    hf = random_llama(tokenizer_dir, seed=4, hidden=256, inter=384)
    path, ref = write_awq_or_gptq(hf, tokenizer_dir, tmp_path / kind, kind)
    prompts = random_prompts(hf.config.vocab_size, [2, 9, 33])
    expected = greedy(ref, prompts, 24)
    with _engine(path) as engine:
        linears = [
            m
            for m in engine.loaded.model.modules()
            if isinstance(m, MatmulWeight) and "weight" in m._parameters
        ]
        assert linears and all(m.quant is not None and m.quant.group == 128 for m in linears)
        assert all(m.weight.numel() == 0 for m in linears)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        got = [list(r.token_ids) for r in engine.generate(prompts, params)]
    assert got == expected


def test_act_order_gptq_is_refused_naming_the_field(tokenizer_dir: Path, tmp_path: Path) -> None:
    import json

    hf = random_llama(tokenizer_dir, seed=5, hidden=256, inter=384)
    path, _ = write_awq_or_gptq(hf, tokenizer_dir, tmp_path / "gptq", "gptq")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quantization_config.desc_act"):
        _engine(path)
