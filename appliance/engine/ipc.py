"""Messages between the API process and the engine core process.

Small msgspec Structs, msgpack-encoded, one frame per message: a 4-byte big-endian signed
length, then the payload. That is the framing of `multiprocessing.Connection.send_bytes`, so
the core side uses a plain `Connection` while the API side reads the same socket with asyncio
streams (never blocking the event loop).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from appliance.engine.outputs import EngineOutput
from appliance.sampling_params import SamplingParams
from appliance.stats import StatsSnapshot

HEADER = struct.Struct("!i")
# Connection.send_bytes switches to an 8-byte length after this marker for > 2 GiB payloads.
LONG_MARKER = -1
LONG_HEADER = struct.Struct("!Q")


# -- API -> core ---------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # A class name or an integer; the core resolves it exactly as Engine.add_request does.
    priority: str | int | None = None
    # time.monotonic() at HTTP arrival: CLOCK_MONOTONIC is system-wide on Linux, so queue
    # timeouts count from when the client asked, not from when the core read the message.
    arrival_time: float
    # The LoRA adapter the request's `model` named ("": the base model).
    lora_name: str = ""


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    # "stop" when the API side's output processor matched a stop string; "queue_timeout" when
    # the API's timer refused a request still queued (`detail` says how long it waited).
    reason: str = "abort"
    detail: str = ""


class GetStats(msgspec.Struct, tag="stats"):
    token: int
    # Seconds of step history to include (0: none, for a metrics scrape).
    history_s: float = 0.0
    detail: bool = False
    # Count the engine process's live per-request objects (a leak check; costs a gc pass).
    count_objects: bool = False


class Ping(msgspec.Struct, tag="ping"):
    token: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class SetPaused(msgspec.Struct, tag="pause"):
    """Stop (or restart) scheduling steps; requests stay queued, aborts and stats still work."""

    paused: bool


class LoadLora(msgspec.Struct, tag="load_lora"):
    """vLLM's /v1/load_lora_adapter: read, check and take a slot (or refuse)."""

    token: int
    name: str
    path: str


class UnloadLora(msgspec.Struct, tag="unload_lora"):
    """vLLM's /v1/unload_lora_adapter: answered once the adapter's requests have finished."""

    token: int
    name: str


ToCore = AddRequest | AbortRequests | GetStats | Ping | Shutdown | SetPaused | LoadLora | UnloadLora


# -- core -> API ---------------------------------------------------------------------------------
class Status(msgspec.Struct, tag="status"):
    """A loading phase (forwarded to the log and to systemd's STATUS=)."""

    text: str


class CoreInfo(msgspec.Struct, tag="ready", kw_only=True):
    model_name: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    num_swap_blocks: int
    block_size: int
    device: str
    dtype: str
    pid: int
    # Seconds per start-up phase, from the loader, plus the core's own imports.
    phase_times: dict[str, float]
    # CPU engines: what the CPU backend detected and picked, and why (appliance.cpu.backend).
    backend: dict[str, Any] = {}
    # LoRA adapters requests may name (name -> path); None: LoRA is off.
    lora_adapters: dict[str, str] | None = None


class Failed(msgspec.Struct, tag="failed"):
    error: str


class AddResult(msgspec.Struct, array_like=True):
    request_id: str
    # "" = queued; "queue_full" = refused by admission control; "invalid" = bad input.
    rejected: str = ""
    detail: str = ""
    # For bad input: OpenAI's error code where one applies (request_checks.InvalidRequest).
    code: str = ""


class Frame(msgspec.Struct, tag="frame", kw_only=True):
    """What one turn of the core loop produced."""

    added: list[AddResult] = []
    # Requests scheduled for the first time this step, sent before its forward pass.
    started: list[str] = []
    outputs: list[EngineOutput] = []
    # (scheduled tokens, sequences) per step, for the per-step histograms.
    steps: list[tuple[int, int]] = []
    # Waiting requests per priority class after this turn (the API's cheap queue-full check).
    waiting_by_class: dict[str, int] = {}
    # Running requests and the measured departure rate (started requests leaving per busy
    # second; None: not measured yet), for the API's estimated-wait admission.
    num_running: int = 0
    departure_rate: float | None = None


class StatsReply(msgspec.Struct, tag="stats_reply", kw_only=True):
    token: int
    snapshot: StatsSnapshot
    live_objects: dict[str, int] = {}


class Pong(msgspec.Struct, tag="pong"):
    token: int


class LoraReply(msgspec.Struct, tag="lora_reply", kw_only=True):
    token: int
    # The HTTP status the API answers with (200, 400 bad adapter, 404 unknown, 409 no slot).
    status: int = 200
    detail: str = ""
    # The adapters after the change (name -> path).
    adapters: dict[str, str] = {}


FromCore = Status | CoreInfo | Failed | Frame | StatsReply | Pong | LoraReply

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)


def frame(payload: bytes) -> bytes:
    """Length-prefixed bytes, exactly as Connection.send_bytes writes them."""
    if len(payload) > 0x7FFFFFFF:
        return HEADER.pack(LONG_MARKER) + LONG_HEADER.pack(len(payload)) + payload
    return HEADER.pack(len(payload)) + payload
