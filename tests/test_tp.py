"""Tensor parallelism on the CPU (gloo): TP 2 and TP 4 give the same greedy tokens as TP 1 in
float32, with KV heads split across ranks and replicated where ranks outnumber them; a killed
worker stops the engine with an error naming it within seconds; start-up refusals do not hang.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance import Engine, SamplingParams
from appliance.config import ConfigError, load_config
from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.engine.tp import TPWorkerError
from appliance.engine.tp_worker import decode_step, encode_step

NEW_TOKENS = 48
LENGTHS = [1, 7, 16, 17, 64, 129, 250]


def engine_for(model_dir: Path, tp: int, **overrides: object) -> Engine:
    base: dict[str, object] = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "cache.kv_cache_memory": 0.125,
        # Every rank allocates its own swap pool; none is needed here.
        "cache.swap_space": 0.0,
        "hardware.device": "cpu",
        "parallel.tensor_parallel_size": tp,
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return Engine(load_config(None, base))


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in LENGTHS]


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def generate(model_dir: Path, tp: int) -> list[list[int]]:
    with engine_for(model_dir, tp) as engine:
        prompts = prompts_for(engine.loaded.args.vocab_size)
        results = engine.generate(prompts, greedy())
        assert engine.kv.pool.num_used_blocks == 0
        return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def one_kv_head_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model cut down to one KV head (the first of its two): at TP 2 both ranks must
    hold a replica of it."""
    out = tmp_path_factory.mktemp("tiny-1kv")
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["num_key_value_heads"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name][:head_dim].contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_step_message_round_trips() -> None:
    """What the driver sends each step decodes to an equal SchedulerOutput on the workers."""
    req = ScheduledRequest(
        request_id="r1",
        token_ids=[5, 6, 7],
        start_pos=16,
        block_ids=[3, 9],
        sample=True,
        sampling_params=SamplingParams(max_tokens=9, temperature=0.7, stop=["x"], seed=4),
        output_index=2,
    )
    out = SchedulerOutput(
        scheduled=[req],
        num_scheduled_tokens=3,
        num_context_tokens=19,
        blocks_to_swap_out=[(1, 2)],
        blocks_to_swap_in=[(4, 5)],
        bound_by="kv_blocks",
    )
    assert decode_step(encode_step(out)) == out


def test_tp2_matches_tp1_with_kv_heads_split(tiny_model_dir: Path) -> None:
    """Tiny has 2 KV heads: at TP 2 each rank holds one (and 4 of the 8 query heads)."""
    reference = generate(tiny_model_dir, 1)
    assert generate(tiny_model_dir, 2) == reference


def test_tp2_matches_tp1_with_kv_head_replicated(one_kv_head_model_dir: Path) -> None:
    """One KV head, two ranks: each rank keeps a full replica of it."""
    reference = generate(one_kv_head_model_dir, 1)
    assert generate(one_kv_head_model_dir, 2) == reference


@pytest.mark.slow
def test_tp4_matches_tp1_with_kv_heads_replicated(tiny_model_dir: Path) -> None:
    """Four ranks over two KV heads: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1."""
    reference = generate(tiny_model_dir, 1)
    assert generate(tiny_model_dir, 4) == reference


def test_killed_worker_stops_the_engine_with_an_error(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, 2)
    try:
        rng = random.Random(5)
        for _ in range(4):
            engine.add_request([rng.randrange(10, 4000) for _ in range(40)], greedy(1000))
        for _ in range(3):
            engine.step()  # running: prefills done, decoding
        worker = engine.executor.workers[0].process
        reasons: list[str] = []
        engine.executor.on_failure = reasons.append
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(worker.pid, signal.SIGKILL)

        threading.Timer(0.2, kill).start()
        with pytest.raises(TPWorkerError, match=r"rank 1 .* killed by SIGKILL") as info:
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - killed_at[0] < 5.0
        assert "engine has stopped" in str(info.value)
        # The hook an idle engine core relies on (called from the monitor thread).
        deadline = time.monotonic() + 2.0
        while not reasons and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reasons == [str(info.value)]
        # The engine stays down: the next step fails at once instead of hanging.
        started = time.monotonic()
        with pytest.raises(TPWorkerError):
            engine.step()
        assert time.monotonic() - started < 1.0
    finally:
        started = time.monotonic()
        engine.close()
        assert time.monotonic() - started < 15.0
    assert all(not w.process.is_alive() for w in engine.executor.workers)


def test_refused_start_does_not_hang_and_frees_the_workers(tiny_model_dir: Path) -> None:
    """Every rank refuses a pool too small for one sequence; the driver reports it and the
    worker processes are gone, so a TP engine can start again in this process (one at a
    time)."""
    started = time.monotonic()
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        engine_for(tiny_model_dir, 2, cache__num_blocks=4)
    assert time.monotonic() - started < 120.0
    assert not torch.distributed.is_initialized()
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("appliance-tp")]
    with engine_for(tiny_model_dir, 2) as engine:
        assert len(engine.generate([[5, 6, 7]], greedy(4))[0].token_ids) == 4
        # One TP group per process: a second engine is refused, not silently mis-sharded.
        for tp in (1, 4):
            with pytest.raises(ConfigError, match="rank 0 of a tensor-parallel engine of size 2"):
                engine_for(tiny_model_dir, tp)
    # Closed: the process is back to TP 1.
    with engine_for(tiny_model_dir, 1) as engine:
        assert len(engine.generate([[5, 6, 7]], greedy(4))[0].token_ids) == 4


def _daemonic_driver(model_dir: str, conn: Connection) -> None:
    """Runs in a daemonic process, as the server's engine core does: start a TP 2 engine,
    report its tokens and worker pids, then wait to be killed."""
    torch.set_num_threads(1)
    engine = engine_for(Path(model_dir), 2)
    tokens = engine.generate([[5, 6, 7, 8]], greedy(8))[0].token_ids
    conn.send((tokens, [w.process.pid for w in engine.executor.workers]))
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_tp_engine_in_a_daemonic_process_and_no_orphans(tiny_model_dir: Path) -> None:
    """The engine core is a daemonic process; TP must start there, and a SIGKILLed driver
    must not leave its workers behind."""
    with engine_for(tiny_model_dir, 1) as ref:
        expected = ref.generate([[5, 6, 7, 8]], greedy(8))[0].token_ids
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    driver = ctx.Process(target=_daemonic_driver, args=(str(tiny_model_dir), child), daemon=True)
    driver.start()
    try:
        assert parent.poll(120), "the daemonic driver did not start its TP engine"
        tokens, pids = parent.recv()
        assert tokens == expected
        assert pids and all(_alive(pid) for pid in pids)
    finally:
        driver.kill()
        driver.join(10)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "workers outlived their killed driver"


def test_tp2_matches_tp1_with_a_kept_kv_head(tiny_model_dir: Path) -> None:
    """FP8 KV with KV head 1 of layer 0 kept 16-bit: at TP 1 layer 0 splits its heads over
    the FP8 cache and a side cache; at TP 2 rank 1 holds that head alone (layer 0 is 16-bit
    there) and rank 0 quantizes its own. The ranks size their pools with the larger rank's
    block, so they agree on the block count, and the answers are TP 1's."""
    kv = {"cache__kv_cache_dtype": "fp8_e4m3", "cache__kv_cache_keep_16bit_heads": ["0:1"]}
    answers = {}
    for tp in (1, 2):
        with engine_for(tiny_model_dir, tp, **kv) as engine:
            # Four of the lengths (one block to several) keep the test short.
            prompts = prompts_for(engine.loaded.args.vocab_size)[2:6]
            answers[tp] = [r.token_ids for r in engine.generate(prompts, greedy())]
            if tp == 1:
                caches = engine.runner.kv.device_caches
                assert [c.side is not None for c in caches] == [True, False, False, False]
    assert answers[2] == answers[1]
