"""Offline, deterministic demo models in Hugging Face format.

No model can be downloaded on the appliance's build and test machines, so everything the engine
is tested against is built here: a byte-level BPE tokenizer trained on a corpus shipped with the
package, and randomly initialised Llama / Qwen2 weights saved with `save_pretrained`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from appliance.models.demo_spec import ARCHS, DEMO_SHAPES, SHAPES, DemoShape, corpus_text

BOS, EOS, IM_START, IM_END, PAD = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|pad|>",
)
# Special tokens come first in the trainer, so their ids are fixed: bos 0, eos 1, ... pad 4.
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]

# ChatML; the bos token is part of the template (as in Llama 3) because transformers renders
# chat prompts with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# Weight init, chosen by measurement (see tests/test_demo_models.py::test_logit_gap). HF's
# default N(0, 0.02) gives a tiny model logits with std ~0.3 that fall into 1-2 token loops
# within a few steps, and ~6% of greedy steps have a top-1/top-2 gap < 1e-3, so two correct
# fp32 implementations can pick different tokens. Matrices here are N(0, (GAIN/sqrt(fan_in))^2):
# every projection and the lm_head then produce values with std ~GAIN from a unit-RMS input,
# which gives logits with std ~1.6, sharp but not one-hot attention, and 300+ token greedy runs
# that stay varied, with activations finite (max |h| ~40 in tiny) in fp32 and bf16.
INIT_GAIN = 1.6
# Norm weights around 1 and non-zero Qwen2 q/k/v biases, so that an engine that drops a norm
# weight or a bias produces different tokens instead of passing by luck.
NORM_WEIGHT_STD = 0.1
BIAS_STD = 0.5
# `small` pads its 8192-token vocabulary to 49152 rows, zero rows past the tokenizer (see
# _init_weights). Zero logits against ~8k real logits of std 1.6 would still take ~58% of the
# probability mass at temperature 1, so sampled ids would mostly be undecodable padding; a final
# norm weight centred at 2.5 raises the real logits' std to ~4 and the padding mass to ~0.3%.
PADDED_FINAL_NORM_MEAN = 2.5


ROPE_THETA = 10000.0


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE on the shipped corpus. Deterministic: same bytes of tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=SPECIAL_TOKENS,
        # All 256 bytes, so that any text round-trips even if the corpus lacks some bytes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer)
    # Plain encodes get a leading bos, as Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))],
    )
    return tok


def _save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        # The default cleanup rewrites " ." to "." on decode, which breaks round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    fast.save_pretrained(str(out_dir))
    # transformers 5 writes tokenizer_class "TokenizersBackend" and a separate
    # chat_template.jinja; the class name and an inline template load in 4.x and 5.x alike.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def _rope_parameters(arch: str, max_pos: int) -> dict[str, Any]:
    if arch != "llama3":
        return {"rope_type": "default", "rope_theta": ROPE_THETA}
    # original = max/8 puts the llama3 thresholds (original/high_freq_factor .. original/
    # low_freq_factor wavelengths) inside the range of a 32-dim head, so all three regimes
    # (kept, smoothed, divided by factor) are exercised.
    return {
        "rope_type": "llama3",
        "rope_theta": ROPE_THETA,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": max(max_pos // 8, 1),
    }


def _make_config(shape: DemoShape, arch: str, vocab: int, max_pos: int) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        rope_parameters=_rope_parameters(arch, max_pos),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
    )
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    return LlamaConfig(**common, tie_word_embeddings=shape.tie_word_embeddings)


@torch.no_grad()
def _init_weights(model: PreTrainedModel, seed: int, real_vocab: int) -> None:
    """Overwrite every parameter from one generator, in sorted-name order (see INIT_GAIN)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        # In place: fresh temporaries cost more in page faults than the sampling itself.
        if name.endswith("norm.weight"):
            padded = name == "model.norm.weight" and _param_vocab(model) > real_vocab
            mean = PADDED_FINAL_NORM_MEAN if padded else 1.0
            param.normal_(mean, NORM_WEIGHT_STD, generator=gen)
        elif name.endswith(".bias"):
            param.normal_(0.0, BIAS_STD, generator=gen)
        else:
            # Embeddings are [vocab, hidden]: their fan-in as a (tied) lm_head is hidden too.
            param.normal_(0.0, INIT_GAIN / math.sqrt(param.shape[-1]), generator=gen)
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                # Rows past the tokenizer are padding: zero logits lie far below the top real
                # logit (~+6), so greedy decoding never emits an id the tokenizer cannot decode.
                param[real_vocab:] = 0.0


def _param_vocab(model: PreTrainedModel) -> int:
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0])


def _clear_weights(out_dir: Path) -> None:
    # A sharded save over a single-file one (or the reverse) would leave two weight sets.
    for path in out_dir.glob("model*.safetensors"):
        path.unlink()
    (out_dir / "model.safetensors.index.json").unlink(missing_ok=True)


def build_demo_model(
    shape: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    arch: str = "llama",
    max_position_embeddings: int | None = None,
    shard_size: str | int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Build a random demo model with its tokenizer into out_dir and return the path.

    shard_size (e.g. "2MB") saves sharded weights with model.safetensors.index.json.
    """
    if shape not in DEMO_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    say = progress or (lambda _msg: None)
    spec = DEMO_SHAPES[shape]
    max_pos = max_position_embeddings or spec.max_position_embeddings
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    say("loading transformers")
    from transformers import GenerationConfig, LlamaForCausalLM, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    say(f"training tokenizer ({spec.tokenizer_vocab} tokens)")
    tok = train_tokenizer(spec.tokenizer_vocab)
    vocab = max(spec.model_vocab, tok.get_vocab_size())
    _save_tokenizer(tok, out, max_pos)

    config = _make_config(spec, arch, vocab, max_pos)
    say(f"initialising {spec.num_hidden_layers} layers ({arch}, hidden {spec.hidden_size})")
    torch.manual_seed(seed)
    model_cls = Qwen2ForCausalLM if arch == "qwen2" else LlamaForCausalLM
    # HF's own init would be overwritten anyway; skipping it saves seconds on `small`.
    with _no_init_weights():
        model = model_cls._from_config(config, dtype=getattr(torch, spec.dtype))
    model.tie_weights()  # not done under no_init_weights; untied, lm_head would be saved
    _init_weights(model, seed, tok.get_vocab_size())
    model.eval()
    # config.json's eos is <|end_of_text|>; generation also stops at <|im_end|>, the end of a
    # chat turn (the same split as Qwen2-Instruct's config.json / generation_config.json).
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, SPECIAL_TOKENS.index(IM_END)],
        pad_token_id=config.pad_token_id,
    )

    say("writing safetensors" + (f" (shards of {shard_size})" if shard_size else ""))
    _clear_weights(out)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard_size is not None:
        kwargs["max_shard_size"] = shard_size
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # our progress lines replace tqdm's
    try:
        model.save_pretrained(str(out), **kwargs)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    for path in out.glob("model*.safetensors"):
        # transformers writes weights 0600; a service user must be able to read them.
        path.chmod(0o644)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"done: {n_params / 1e6:.1f}M parameters, vocab {vocab}, {spec.dtype} -> {out}")
    return out


def _no_init_weights() -> Any:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        # (this transformers' stubs are 5.x: the 4.x location is unknown to them)
        from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]
    return no_init_weights()
