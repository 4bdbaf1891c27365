"""Run-time LoRA loads and unloads at tensor parallel size 2 (gloo, two processes): over HTTP
against a real `appliance up` with the OpenAI SDK as the client, an adapter loaded while
requests run gives transformers + peft's greedy text; a load with every slot busy is a 409, a
bad adapter a 400 naming the field, and the ranks stay in step after either; an unload makes
the name a 404. In-process: a load that fails on one rank leaves no rank holding the adapter,
answers the rank and the cause, and later loads and requests still match peft."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import openai
import pytest

from appliance import Engine, SamplingParams
from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.engine.lora_admin import LoraAdmin
from appliance.engine.rank_commands import (
    ListAdapters,
    LoadAdapter,
    UnloadAdapter,
    decode_command,
    encode_command,
    is_command,
)
from appliance.engine.tp_worker import encode_step
from appliance.models.peft_adapter import LoraAdapter
from tests.lora_fixtures import peft_greedy, save_random_adapter
from tests.server_harness import ServerProcess, write_template
from tests.test_lora_exact import lora_engine
from tests.test_lora_server import ADMIN, ADMIN_AUTH, complete, expected_text, sdk

LONG = 150


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-adapters")
    return {
        "a": save_random_adapter(tiny_model_dir, root / "a", seed=31),
        "b": save_random_adapter(
            tiny_model_dir, root / "b", seed=32, rank=4, targets=["q_proj", "v_proj", "down_proj"]
        ),
        # Rank 16: more than the pools' lora.max_lora_rank 8.
        "wide": save_random_adapter(tiny_model_dir, root / "wide", seed=33, rank=16),
    }


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
):
    d = tmp_path_factory.mktemp("srv-lora-tp")
    (d / "admin.token").write_text(f"{ADMIN}\n")
    template = write_template(
        d / "t.toml",
        tiny_model_dir,
        extra=f"""
[server]
admin_token_file = "{d / "admin.token"}"
[parallel]
tensor_parallel_size = 2
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


def load(server: ServerProcess, name: str, path: Path) -> tuple[int, str]:
    r = server.post(
        "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        headers=ADMIN_AUTH,
    )
    return r.status_code, r.text


def test_hot_load_and_unload_at_tp2_while_requests_run(
    server: ServerProcess, tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    # A long request on "a" holds the only slot: loading "b" now would evict a busy adapter.
    long_a = threading.Thread(target=complete, args=(server, "a", LONG))
    long_a.start()
    time.sleep(0.5)
    status, text = load(server, "b", adapters["b"])
    assert status == 409 and "lora.max_loras" in text, text
    # A bad adapter is refused on rank 0 before any rank is told, naming the field.
    status, text = load(server, "wide", adapters["wide"])
    assert status == 400 and "r 16 exceeds lora.max_lora_rank 8" in text, text
    long_a.join()

    # Loaded while a base request runs: the load happens between its steps, on both ranks.
    texts: list[str] = []
    base = threading.Thread(target=lambda: texts.append(complete(server, "tiny", LONG)))
    base.start()
    time.sleep(0.5)
    status, text = load(server, "b", adapters["b"])
    assert status == 200, text
    assert complete(server, "b") == expected_text(tiny_model_dir, adapters["b"])
    base.join()
    # Undisturbed by the load: the same text as that request alone (the text, not the token
    # ids, comes back: 150 tokens of partial UTF-8 decode apart from tokenizer.decode's).
    assert texts == [complete(server, "tiny", LONG)]
    assert complete(server, "tiny") == expected_text(tiny_model_dir, None)
    # "a" gave its slot to "b" on every rank and takes it back when asked.
    assert complete(server, "a") == expected_text(tiny_model_dir, adapters["a"])
    assert complete(server, "b") == expected_text(tiny_model_dir, adapters["b"])
    assert {m.id for m in sdk(server).models.list().data} == {"tiny", "a", "b"}

    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "b"}, headers=ADMIN_AUTH)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError, match="'b'"):
        complete(server, "b")
    # The slot is free on every rank: "b" loads again, and "a" still answers as peft does.
    assert load(server, "b", adapters["b"])[0] == 200
    assert complete(server, "b") == expected_text(tiny_model_dir, adapters["b"])
    assert complete(server, "a") == expected_text(tiny_model_dir, adapters["a"])


def test_commands_share_the_step_pipe_without_being_taken_for_steps() -> None:
    """A step's msgpack never begins with the command mark, and commands round-trip."""
    req = ScheduledRequest(
        request_id="r1",
        token_ids=[1, 2, 3],
        start_pos=0,
        block_ids=[0],
        sample=True,
        sampling_params=SamplingParams(max_tokens=4),
        output_index=0,
        lora_name="a",
        lora_slot=0,
    )
    step = SchedulerOutput(scheduled=[req], num_scheduled_tokens=3)
    assert not is_command(encode_step(step)) and not is_command(encode_step(SchedulerOutput()))
    for command in (LoadAdapter("a", "/srv/a", 3), UnloadAdapter("a")):
        data = encode_command(command)
        assert is_command(data) and decode_command(data) == command


PROMPTS = [[5, 17, 301, 42, 9, 77, 123], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
NEW = 10


def run(engine: Engine, name: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    results = engine.generate(PROMPTS, params, lora_names=[name] * len(PROMPTS))
    return [r.token_ids for r in results]


def held_by_rank_1(engine: Engine) -> tuple[list[str], list[str | None]]:
    """Rank 1's adapters on the host and what each of its slots holds, as it answers."""
    ((rank, done),) = engine.loaded.workers.run_command(ListAdapters())
    assert rank == 1 and not done.error
    return done.adapters, done.slots


def test_a_load_failing_on_one_rank_leaves_no_rank_holding_it(
    tiny_model_dir: Path,
    adapters: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The adapter's files change on disk between rank 0's check and rank 1's read (rank 1
    finds a rank-16 adapter there): a 400 naming rank 1 and the field. Then rank 0 fails after
    rank 1 filled the slot (an injected MemoryError): a 500 naming rank 0 and the cause, and
    rank 1's slot is empty again, not left holding "b". Each time no rank keeps the adapter
    (rank 1 says what it holds), and later loads, requests and an unload agree with peft and
    across the ranks."""
    with lora_engine(
        tiny_model_dir,
        {"a": adapters["a"]},
        parallel__tensor_parallel_size=2,
        cache__swap_space=0.0,
        lora__max_loras=1,
        lora__max_lora_rank=8,
    ) as engine:
        pool = engine.runner.lora
        assert pool is not None
        admin = LoraAdmin(engine)
        want_a = peft_greedy(tiny_model_dir, adapters["a"], PROMPTS, NEW)
        want_b = peft_greedy(tiny_model_dir, adapters["b"], PROMPTS, NEW)
        assert run(engine, "a") == want_a  # "a" fills the only slot on both ranks

        # The files at `changing` are "b"'s when rank 0 reads them, "wide"'s right after.
        changing = tmp_path / "changing"
        shutil.copytree(adapters["b"], changing)
        read = pool.read

        def then_the_file_changes(name: str, path: str) -> LoraAdapter:
            adapter = read(name, path)
            shutil.copytree(adapters["wide"], changing, dirs_exist_ok=True)
            return adapter

        with monkeypatch.context() as m:
            m.setattr(pool, "read", then_the_file_changes)
            answer = admin.load("b", str(changing))
        assert answer.status == 400, answer.detail
        assert "r 16 exceeds lora.max_lora_rank 8" in answer.detail
        assert "tensor-parallel rank 1" in answer.detail
        assert "b" not in pool.adapters and "b" not in engine.scheduler.lora_slots.slots
        assert "b" not in engine.lora_adapters()
        assert held_by_rank_1(engine) == (["a"], ["a"])  # it failed reading: nothing touched
        assert run(engine, "a") == want_a

        def rank0_breaks(adapter: LoraAdapter, slot: int) -> None:
            raise MemoryError("no room for the factors")

        with monkeypatch.context() as m:
            m.setattr(pool, "place", rank0_breaks)
            answer = admin.load("b", str(adapters["b"]))
        assert answer.status == 500 and "rank 0" in answer.detail, answer.detail
        assert "MemoryError: no room for the factors" in answer.detail
        assert "b" not in pool.adapters and "b" not in engine.scheduler.lora_slots.slots
        # Rank 1 had filled the slot with "b", then dropped it: the slot is marked empty.
        assert held_by_rank_1(engine) == (["a"], [None])
        assert run(engine, "a") == want_a
        assert held_by_rank_1(engine) == (["a"], ["a"])

        assert admin.load("b", str(adapters["b"])).status == 200
        # Filled at the load on both ranks, before any request names it.
        assert held_by_rank_1(engine) == (["a", "b"], ["b"]) and pool.slot_names == ["b"]
        assert run(engine, "b") == want_b
        assert run(engine, "a") == want_a
        assert want_a != want_b
        assert admin.begin_unload(7, "b") is None
        assert [(token, a.status) for token, a in admin.finished_unloads()] == [(7, 200)]
        assert held_by_rank_1(engine) == (["a"], ["a"])
        assert "b" not in pool.adapters and pool.slot_names == ["a"]
