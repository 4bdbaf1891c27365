"""LoRA over HTTP, against a real `appliance up` and the OpenAI SDK as the client: `model`
selects an adapter (greedy text equal to transformers + peft), /v1/models lists adapters with
their parent, an unknown model is a 404 naming it, and vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter work while requests run (admin token; a load with every slot busy is a
409; an unload waits for the adapter's running request)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.lora_fixtures import peft_greedy, save_random_adapter
from tests.server_harness import ServerProcess, write_template

ADMIN = "lora-admin-token"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = [5, 17, 301, 42, 9, 77, 123]
NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("http-adapters")
    return {
        "a": save_random_adapter(tiny_model_dir, root / "a", seed=21),
        "b": save_random_adapter(tiny_model_dir, root / "b", seed=22, rank=4),
    }


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
):
    d = tmp_path_factory.mktemp("srv-lora")
    (d / "admin.token").write_text(f"{ADMIN}\n")
    template = write_template(
        d / "t.toml",
        tiny_model_dir,
        extra=f"""
[server]
admin_token_file = "{d / "admin.token"}"
# Its own audit log: the session's other servers (test_lora_tp_load's) write LoRA loads too.
state_dir = "{d}"
[lora]
adapters = {{ a = "{adapters["a"]}" }}
max_loras = 1
max_lora_rank = 8
""",
    )
    # Every step 20 ms longer: a 150-token request runs for seconds, long enough to overlap.
    srv = ServerProcess(
        template, d / "log.txt", env={"APPLIANCE_TEST_STEP_DELAY_S": "0.02"}
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def complete(server: ServerProcess, model: str, max_tokens: int = NEW) -> str:
    out = sdk(server).completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def lora_info(server: ServerProcess) -> Any:
    text = server.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = fams["vllm:lora_requests_info"].samples
    assert len(samples) == 1
    return samples[0]


def expected_text(model_dir: Path, adapter: Path | None) -> str:
    tokens = peft_greedy(model_dir, adapter, [PROMPT], NEW)[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.decode(tokens)


def test_models_lists_adapters_with_their_parent(server: ServerProcess) -> None:
    cards = {m.id: m for m in sdk(server).models.list().data}
    assert set(cards) == {"tiny", "a"}
    assert cards["a"].model_extra is not None and cards["a"].model_extra["parent"] == "tiny"


def test_model_selects_the_adapter(
    server: ServerProcess, tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    assert complete(server, "a") == expected_text(tiny_model_dir, adapters["a"])
    assert complete(server, "tiny") == expected_text(tiny_model_dir, None)


def test_unknown_model_is_a_404_naming_it(server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError, match="'nope'"):
        complete(server, "nope")


def test_load_and_unload_while_requests_run(
    server: ServerProcess, tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    body = {"lora_name": "b", "lora_path": str(adapters["b"])}
    assert server.post("/v1/load_lora_adapter", json=body).status_code == 401
    # A long request on "a" holds the only slot: loading "b" now would evict a busy adapter.
    long_a = threading.Thread(target=complete, args=(server, "a", 150))
    long_a.start()
    time.sleep(0.5)
    r = server.post("/v1/load_lora_adapter", json=body, headers=ADMIN_AUTH)
    assert r.status_code == 409, r.text
    assert "lora.max_loras" in r.json()["error"]["message"]
    # vLLM's series names the running adapter and the slot count.
    info = lora_info(server)
    assert info.labels["running_lora_adapters"] == "a" and info.labels["max_lora"] == "1"
    assert info.value > 1e9  # stamped with the time, as vLLM's
    long_a.join()
    r = server.post("/v1/load_lora_adapter", json=body, headers=ADMIN_AUTH)
    assert r.status_code == 200, r.text
    assert {m.id for m in sdk(server).models.list().data} == {"tiny", "a", "b"}
    assert complete(server, "b") == expected_text(tiny_model_dir, adapters["b"])
    # "a" left its slot to "b" but stays loaded: it takes the slot back when asked.
    assert complete(server, "a") == expected_text(tiny_model_dir, adapters["a"])

    # An unload waits for the adapter's running request, then the name is gone.
    texts: list[str] = []
    runner = threading.Thread(target=lambda: texts.append(complete(server, "b", 150)))
    runner.start()
    time.sleep(0.5)
    asked = time.monotonic()
    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=ADMIN_AUTH)
    waited = time.monotonic() - asked
    runner.join()
    assert r.status_code == 200, r.text
    # 150 steps of >= 20 ms: the unload waited for the running request, which ran to its end.
    assert waited > 1.5, f"unload answered after {waited:.2f}s, before the request ended"
    assert len(texts) == 1 and texts[0]
    assert {m.id for m in sdk(server).models.list().data} == {"tiny", "a"}
    with pytest.raises(openai.NotFoundError, match="'b'"):
        complete(server, "b")
    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=ADMIN_AUTH)
    assert r.status_code == 404

    # Each load and unload is in the audit log, with its outcome (the 409 and 404 refused).
    records = server.get("/admin/audit", headers=ADMIN_AUTH).json()["records"]
    outcomes = [
        (r["action"], r["what"]["lora_name"], r["outcome"])
        for r in records
        if r["action"].startswith("lora_")
    ]
    assert outcomes == [
        ("lora_load", "b", "refused"),
        ("lora_load", "b", "ok"),
        ("lora_unload", "b", "ok"),
        ("lora_unload", "b", "refused"),
    ], outcomes


def test_bad_adapter_is_a_400_naming_the_field(server: ServerProcess, tmp_path: Path) -> None:
    r = httpx.post(
        server.url + "/v1/load_lora_adapter",
        json={"lora_name": "c", "lora_path": str(tmp_path)},
        headers=ADMIN_AUTH,
        timeout=60,
    )
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]


async def test_console_shows_adapters_and_their_requests(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dashboard's batch panel: slots in use, each adapter (* = in a slot) with its
    running/waiting requests, as /admin/stats reports them."""
    from appliance.console.app import ConsoleApp

    from tests.test_console import no_nvml, screen_text, until

    no_nvml(monkeypatch)
    busy = threading.Thread(target=complete, args=(server, "a", 150))
    busy.start()
    try:
        app = ConsoleApp(server.url, ADMIN, poll_s=0.2)
        async with app.run_test(size=(160, 48)) as pilot:
            await until(pilot, lambda: "a* 1/0" in screen_text(app), 20, "adapter a running")
            assert "LoRA 1/1 slots, running/waiting:" in screen_text(app)
    finally:
        busy.join()
