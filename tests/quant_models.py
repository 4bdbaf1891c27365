"""Small random models written in quantized formats by the tests themselves, each beside the
fp32 Hugging Face model of exactly the weights the format stores (dequantized by the format's
own reference, not by the appliance): GGUF through the `gguf` package's writer and quantizers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

# Row lengths are multiples of 32 (ggml blocks) but not of 64: the 32-column runs' tails.
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 96, 160, 2, 4, 2


def random_llama(
    tokenizer_dir: Path,
    seed: int = 0,
    tied: bool = False,  # type: ignore[no-untyped-def]
    hidden: int = HIDDEN,
    inter: int = INTER,
):
    """A random fp32 Llama over the tokenizer of `tokenizer_dir` (its vocab)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    vocab = -(-vocab // 32) * 32
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        # Wider than transformers' N(0, 0.02): logits far enough apart that greedy choices do
        # not hinge on float32 summation order.
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (interleaved rotary)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama_cpp_unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


# K-quant super-block scales giving weights of about N(0, 0.08) from uniform random bytes: Q4_K
# is d * sc * q - dmin * m (sc, m 6-bit, q 4-bit), Q6_K d * sc * (q - 32) (sc int8, q 6-bit).
_K_SCALES = {"Q4_K": ((0, 4.4e-4), (2, 4.4e-4)), "Q6_K": ((208, 6e-5),)}
_K_BLOCK = {"Q4_K": 144, "Q6_K": 210}


def random_kquant(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Bytes of n rows of k columns of a K-quant: the gguf package cannot quantize to these
    types, but every byte pattern of their sub-scales and values is a valid block, so random
    bytes with fp16 super-block scales of a chosen size make a weight matrix."""
    raw = rng.integers(0, 256, (n, k // 256, _K_BLOCK[name]), dtype=np.uint8)
    for offset, scale in _K_SCALES[name]:
        d = rng.uniform(0.5 * scale, 1.5 * scale, (n, k // 256)).astype(np.float16)
        raw[..., offset : offset + 2] = d.view(np.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def _tensor_type(qtype: str, gguf_name: str) -> str:
    # "Q4_K_M" as llama.cpp mixes it: Q6_K for the FFN down projections and the output head.
    if qtype == "Q4_K_M":
        return "Q6_K" if gguf_name.endswith(("ffn_down.weight", "output.weight")) else "Q4_K"
    return qtype


def write_gguf(model, tokenizer_dir: Path, out_dir: Path, qtype: str):  # type: ignore[no-untyped-def]
    """Write `model` as a GGUF file of ggml type `qtype` (norms F32; "Q4_K_M" mixes Q4_K and
    Q6_K, whose weights are random blocks rather than `model`'s) with the tokenizer beside it;
    returns (the .gguf path, the fp32 HF model of the weights the file holds)."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    cfg = model.config
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"model.{qtype}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = tensor.detach().float()
        heads = None
        if name.endswith("q_proj.weight"):
            heads = cfg.num_attention_heads
        elif name.endswith("k_proj.weight"):
            heads = cfg.num_key_value_heads
        if heads is not None:
            t = llama_cpp_permute(t, heads)
        if t.dim() == 2:
            kind = _tensor_type(qtype, _gguf_name(name))
            qt = getattr(gguf.GGMLQuantizationType, kind)
            if kind in _K_BLOCK:
                raw = random_kquant(kind, t.shape[0], t.shape[1], rng)
            else:
                raw = quantize(t.numpy(), qt)
            back = torch.from_numpy(dequantize(raw, qt).copy()).reshape(t.shape)
            writer.add_tensor(_gguf_name(name), raw, raw_shape=raw.shape, raw_dtype=qt)
        else:
            writer.add_tensor(_gguf_name(name), t.numpy())
            back = t
        stored[name] = llama_cpp_unpermute(back, heads) if heads is not None else back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out_dir / f)
    ref = type(model)(cfg).float().eval()
    missing = ref.load_state_dict(stored, strict=False)
    assert not missing.unexpected_keys, missing
    if cfg.tie_word_embeddings:
        ref.tie_weights()
    return path, ref


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_GGUF_NAMES[module]}.{parts[-1]}"


def greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """transformers' greedy continuation of each prompt (EOS not stopping it)."""
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def random_prompts(vocab: int, lengths: list[int], seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, n).tolist() for n in lengths]


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def rtn_4bit(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest 4-bit of W [N, K] in groups along K: (q [N, K] 0..15, scale
    fp16 [N, K/g], zero [N, K/g] 1..15); weight = (q - zero) * scale."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-4).half()
    # Zero 0 cannot be written in GPTQ's v1 format (it stores zero - 1): keep it >= 1.
    zero = torch.round(-lo / scale.float()).clamp(1, 15)
    q = torch.round(g / scale.float().unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)
    return q.reshape(n, k).to(torch.int64), scale, zero.to(torch.int64)


def _pack_words(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int64 [..., 8 W] 0..15 -> int32 [..., W]; nibble i of word c = value 8 c + order[i]."""
    v = values.reshape(*values.shape[:-1], -1, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i, j in enumerate(order):
        word |= v[..., j] << (4 * i)
    return word.to(torch.int32)


def write_awq_or_gptq(model, tokenizer_dir: Path, out_dir: Path, kind: str, group: int = 128):  # type: ignore[no-untyped-def]
    """The linears of `model` quantized (RTN, 4 bits, `group`) and packed the way AutoAWQ's
    gemm kernels / AutoGPTQ store them, in a HF directory with quantization_config; returns
    (the directory, the fp32 HF model of the dequantized weights)."""
    import json

    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    ref_state: dict[str, torch.Tensor] = {}
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, t in model.state_dict().items():
        t = t.detach().float().contiguous()
        module = name.rsplit(".", 2)
        if len(module) == 3 and module[1] in linears and module[2] == "weight":
            prefix = name[: -len(".weight")]
            q, scale, zero = rtn_4bit(t, group)
            ref_state[name] = (
                q - zero.repeat_interleave(group, 1)
            ) * scale.float().repeat_interleave(group, 1)
            qt, zt = q.t().contiguous(), zero.t().contiguous()  # [K, N], [K/g, N]
            if kind == "awq":
                tensors[prefix + ".qweight"] = _pack_words(qt, AWQ_ORDER)
                tensors[prefix + ".qzeros"] = _pack_words(zt, AWQ_ORDER)
            else:
                tensors[prefix + ".qweight"] = _pack_words(qt.t()).t().contiguous()  # along K
                tensors[prefix + ".qzeros"] = _pack_words(zt - 1)
                tensors[prefix + ".g_idx"] = (torch.arange(t.shape[1]) // group).to(torch.int32)
            tensors[prefix + ".scales"] = scale.t().contiguous()
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            tensors[name] = t
            ref_state[name] = t
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    if kind == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": False,
        }
    (out_dir / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out_dir / f)
    ref = type(model)(model.config).float().eval()
    ref.load_state_dict(ref_state, strict=not model.config.tie_word_embeddings)
    return out_dir, ref
