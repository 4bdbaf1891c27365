"""`appliance bench host-phases`: py-spy's raw stacks of the core and the API process become
milliseconds per engine step by phase, each sample going to the innermost frame that names a
phase, the API's worker threads left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.bench.host_phases import API_PHASES, CORE_PHASES, phase_samples
from appliance.cli import main

LOOP = "<module> (<string>:1);core_main (appliance/engine/core_process.py:56);_Core.run (appliance/engine/core_process.py:198)"
STEP = f"{LOOP};_Core._step (appliance/engine/core_process.py:214);Engine.step (appliance/engine/llm_engine.py:204)"
EXECUTE = f"{STEP};ModelRunner.execute (appliance/engine/model_runner.py:150)"
CORE_RAW = "\n".join(
    [
        f"{EXECUTE};FusedCpuDecode.__call__ (appliance/cpu/fused_decode.py:196);run_decode_forward (appliance/cpu/fused_decode.py:80) 300",
        # The sampler inside the runner is the sampler's, however deep its own frames go.
        f"{EXECUTE};decorate_context (torch/utils/_contextlib.py:120);Sampler.__call__ (appliance/engine/sampler.py:63);argmax_rows (appliance/engine/sampler.py:134) 20",
        f"{EXECUTE};ModelRunner._prepare (appliance/engine/model_runner.py:239);ModelRunner._prepare_decodes (appliance/engine/model_runner.py:306) 4",
        f"{STEP};Scheduler.schedule (appliance/core/scheduler.py:190);StepBuilder.build (appliance/core/step_builder.py:289) 6",
        f"{STEP} 2",
        f"{LOOP};_send (appliance/engine/core_process.py:109);Connection._send (multiprocessing/connection.py:384) 8",
        f"{LOOP};_ConnectionBase.poll (multiprocessing/connection.py:257);Connection._poll (multiprocessing/connection.py:440);wait (multiprocessing/connection.py:947) 60",
    ]
)
MAIN = "cmd_up (appliance/server/daemon.py:61);BaseEventLoop.run_forever (asyncio/base_events.py:607);BaseEventLoop._run_once (asyncio/base_events.py:1922)"
API_RAW = "\n".join(
    [
        f"{MAIN};EpollSelector.select (selectors.py:468) 350",
        f"{MAIN};Handle._run (asyncio/events.py:80);EngineClient._read_loop (appliance/engine/client.py:180);EngineClient._dispatch (appliance/engine/client.py:214);OutputProcessor.process (appliance/engine/output_processor.py:116);IncrementalDetokenizer.add (appliance/engine/detokenizer.py:97) 10",
        f"{MAIN};Handle._run (asyncio/events.py:80);ASGIStreamingResponse._stream (litestar/response/streaming.py:93);RequestResponseCycle.send (uvicorn/protocols/http/h11_impl.py:499) 30",
        # A tokenizer thread idling: not the event loop's time.
        "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81) 400",
    ]
)


def test_each_sample_goes_to_its_innermost_phase() -> None:
    core = phase_samples(CORE_RAW, CORE_PHASES, main_thread_only=False)
    assert core == {
        "forward: fused native decode": 300,
        "sampler": 20,
        "runner: input tensors": 4,
        "scheduler: schedule": 6,
        "engine: outputs": 2,
        "ipc: send": 8,
        "idle (waiting for work)": 60,
    }
    api = phase_samples(API_RAW, API_PHASES, main_thread_only=True)
    assert api == {"idle (waiting for work)": 350, "detokenize": 10, "HTTP: write": 30}


def test_the_table_is_milliseconds_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "core.txt").write_text(CORE_RAW)
    (tmp_path / "api.txt").write_text(API_RAW)
    args = ["bench", "host-phases", "--core", str(tmp_path / "core.txt")]
    args += ["--api", str(tmp_path / "api.txt"), "--steps", "20", "--rate", "100", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    # 300 samples at 100 Hz over 20 steps: 150 ms a step.
    assert out["core"]["forward: fused native decode"] == pytest.approx(150.0)
    assert out["core"]["sampler"] == pytest.approx(10.0)
    assert list(out["core"])[0] == "forward: fused native decode"  # largest first
    # The core's 400 samples: 200 ms a step; the API's event loop's 390 (its worker thread's
    # 400 left out): 195 ms.
    assert sum(out["core"].values()) == pytest.approx(200.0)
    assert sum(out["api"].values()) == pytest.approx(195.0)


def test_steps_below_one_are_refused(tmp_path: Path) -> None:
    (tmp_path / "core.txt").write_text(CORE_RAW)
    with pytest.raises(SystemExit, match="--steps must be at least 1"):
        main(["bench", "host-phases", "--core", str(tmp_path / "core.txt"), "--steps", "0"])
