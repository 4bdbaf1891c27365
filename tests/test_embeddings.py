"""POST /v1/embeddings through the official openai SDK against a real `appliance up` serving a
Qwen3-Embedding-shaped model (model.task = "embed", last-token pooling from its
sentence-transformers config), and the engine's pooling offline: every vector equals
transformers' own hidden-state pooling of the same weights (AutoModel's last_hidden_state,
last token or mean, L2-normalised) in float32 to 1e-4; base64 decodes to the same floats; a
batch of 64 inputs takes a few engine steps as prefill-only requests whose blocks are all free
afterwards; the refusals name the field and the limit."""

from __future__ import annotations

import base64
import random
import struct
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from embedding_models import build_embedding_model
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, write_template
from transformers import AutoModel, AutoTokenizer

from appliance import Engine, SamplingParams
from appliance.config import load_config

MODEL = "tiny"
TEXTS = ["The capital of France is Paris.", "hello", "Embeddings map text to vectors. " * 9]
MAX_INPUTS = 70


@pytest.fixture(scope="module")
def embed_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_embedding_model(tmp_path_factory.mktemp("embed-model"))


@pytest.fixture(scope="module")
def reference(embed_model_dir: Path) -> Any:
    return AutoModel.from_pretrained(embed_model_dir, dtype=torch.float32).eval()


def pooled(model: Any, ids: list[int], kind: str) -> torch.Tensor:
    """transformers' pooling of the final hidden states, L2-normalised (the reference)."""
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vector = hidden[-1] if kind == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0)


@pytest.fixture(scope="module")
def server(embed_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-embed")
    template = write_template(
        d / "t.toml", embed_model_dir, scheduler={"max_num_batched_tokens": 64}
    )
    text = template.read_text().replace('name = "tiny"', 'name = "tiny"\ntask = "embed"')
    template.write_text(text + f"\n[server]\nmax_embedding_inputs = {MAX_INPUTS}\n")
    srv = ServerProcess(template, d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_strings_and_token_ids_equal_transformers_pooling(
    client: openai.OpenAI, embed_model_dir: Path, reference: Any
) -> None:
    tok = AutoTokenizer.from_pretrained(embed_model_dir)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert all(i[-1] == tok.eos_token_id for i in ids)  # Qwen3-Embedding's appended EOS
    refs = [pooled(reference, i, "last") for i in ids]
    # Without encoding_format the SDK asks for base64 and decodes it itself (numpy).
    for fmt in ({}, {"encoding_format": "float"}):
        resp = client.embeddings.create(model=MODEL, input=TEXTS, **fmt)  # type: ignore[arg-type]
        assert [d.index for d in resp.data] == [0, 1, 2]
        for d, ref in zip(resp.data, refs, strict=True):
            torch.testing.assert_close(torch.tensor(d.embedding), ref, atol=1e-4, rtol=0)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    for d, ref in zip(by_ids.data, refs, strict=True):
        torch.testing.assert_close(torch.tensor(d.embedding), ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), refs[1], atol=1e-4, rtol=0)


def test_base64_decodes_to_the_float_vector(server: ServerProcess) -> None:
    def ask(fmt: str) -> Any:
        r = httpx.post(
            server.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": fmt}
        )
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"]

    floats, packed = ask("float"), base64.b64decode(ask("base64"))
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(floats, abs=1e-7)


def test_dimensions_shorten_then_normalise(client: openai.OpenAI, reference: Any) -> None:
    full = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    short = client.embeddings.create(
        model=MODEL, input=TEXTS[0], dimensions=32, encoding_format="float"
    )
    head = torch.nn.functional.normalize(torch.tensor(full.data[0].embedding[:32]), dim=0)
    assert len(short.data[0].embedding) == 32
    torch.testing.assert_close(torch.tensor(short.data[0].embedding), head, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", "at most 70"),
        ({"input": [[5, 6], "text"]}, "input", "a list of strings"),
        ({"input": []}, "input", "non-empty"),
        ({"input": ["fine", ""]}, "input[1]", "empty"),
        ({"input": [[5] * 600]}, "input[0]", "maximum context length is 512"),
        ({"input": [[5, 99999]]}, "input[0]", "outside the vocabulary"),
        ({"input": [5, 99999]}, "input", "outside the vocabulary"),
        ({"input": "x", "dimensions": 100000}, "dimensions", "exceeds"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "x", "priority": "nonesuch"}, "priority", "unknown class"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, words: str
) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_an_embedding_model_refuses_generation(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "model.task" in str(exc.value)


def _counter(server: ServerProcess, name: str) -> float:
    for fam in text_string_to_metric_families(server.get("/metrics").text):
        for sample in fam.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not exported")


def test_embedding_requests_are_counted_apart(server: ServerProcess, client: openai.OpenAI) -> None:
    before = _counter(server, "appliance_embedding_requests_total")
    inputs = _counter(server, "appliance_embedding_inputs_total")
    client.embeddings.create(model=MODEL, input=TEXTS)
    assert _counter(server, "appliance_embedding_requests_total") == before + 1
    assert _counter(server, "appliance_embedding_inputs_total") == inputs + len(TEXTS)


# -- the engine, offline -------------------------------------------------------------------------
def _engine(model_dir: Path, **overrides: Any) -> Engine:
    base = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "cache.kv_cache_memory": 0.05,
        "hardware.device": "cpu",
        **overrides,
    }
    return Engine(load_config(None, base))


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_chunked_prefill_pools_as_transformers_does(qwen2_model_dir: Path, kind: str) -> None:
    # A generation model serves embeddings too; 40-token chunks split the long prompts.
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 4000) for _ in range(n)] for n in (1, 7, 40, 41, 130)]
    reference = AutoModel.from_pretrained(qwen2_model_dir, dtype=torch.float32).eval()
    with _engine(qwen2_model_dir, **{"scheduler.max_num_batched_tokens": 40}) as engine:
        results = engine.generate(prompts, SamplingParams(pooling=kind))
        assert engine.kv.num_free_blocks == engine.kv.num_blocks  # nothing kept
    for prompt, result in zip(prompts, results, strict=True):
        assert result.finish_reason == "stop" and result.token_ids == []
        got = torch.nn.functional.normalize(torch.tensor(result.embedding), dim=0)
        torch.testing.assert_close(got, pooled(reference, prompt, kind), atol=1e-4, rtol=0)


def test_a_batch_of_64_inputs_is_a_few_prefill_only_steps(embed_model_dir: Path) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.randrange(4, 24))] for _ in range(64)]
    overrides = {"scheduler.max_num_seqs": 64, "scheduler.max_num_batched_tokens": 2048}
    with _engine(embed_model_dir, **overrides) as engine:
        solo = engine.generate(prompts[:1], SamplingParams(pooling="last"))[0].embedding
        steps = engine.step_count
        results = engine.generate(prompts, SamplingParams(pooling="last"))
        taken = engine.step_count - steps
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert taken <= 2, taken  # one forward for all 64 (plus the step that reports them)
    assert all(len(r.embedding) == len(solo) for r in results)
    # Batched with 63 others, the first prompt's vector is the one it gets alone.
    torch.testing.assert_close(
        torch.tensor(results[0].embedding), torch.tensor(solo), atol=1e-5, rtol=0
    )
