"""Demo models: transformers loads them, builds are deterministic, HF dirs are read correctly."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from appliance.models.args import rope_parameters
from appliance.models.demo_model import CHAT_TEMPLATE, build_demo_model
from appliance.models.demo_spec import corpus_text
from appliance.models.hf_files import (
    has_model,
    iter_safetensors,
    load_hf_config,
    load_tokenizer,
    safetensors_files,
)
from appliance.tools.demo_model import add_demo_model_parser, demo_model_command

BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(5)


def _hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()


def _greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_ID,
        )
    return out[0, len(ids) :].tolist()


def test_tiny_loads_and_generates(tiny_model_dir: Path) -> None:
    cfg = load_hf_config(tiny_model_dir)
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 2)
    assert cfg.intermediate_size == 688 and cfg.max_position_embeddings == 4096
    assert cfg.tie_word_embeddings is False
    assert rope_parameters(cfg) == {"rope_type": "default", "rope_theta": 10000.0}
    tok = load_tokenizer(tiny_model_dir)
    assert len(tok) == cfg.vocab_size == 4096
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    gen_cfg = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen_cfg["bos_token_id"] == BOS_ID
    assert gen_cfg["eos_token_id"] == [EOS_ID, IM_END_ID]

    model = _hf_model(tiny_model_dir)
    assert next(model.parameters()).dtype == torch.float32
    ids = tok("The incident review found a missing index.")["input_ids"]
    out = _greedy(model, ids, 12)
    assert len(out) == 12 and all(0 <= t < 4096 for t in out)
    assert isinstance(tok.decode(out), str)


def test_qwen2_loads_and_generates(qwen2_model_dir: Path) -> None:
    cfg = load_hf_config(qwen2_model_dir)
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings is True
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (256, 8, 2)
    tensors = dict(iter_safetensors(qwen2_model_dir))
    assert "lm_head.weight" not in tensors  # tied to the embeddings
    for proj in ("q_proj", "k_proj", "v_proj"):
        bias = tensors[f"model.layers.0.self_attn.{proj}.bias"]
        assert bias.abs().mean() > 0.1  # a dropped bias must change the output
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    model = _hf_model(qwen2_model_dir)
    out = _greedy(model, load_tokenizer(qwen2_model_dir)("Hello there")["input_ids"], 8)
    assert len(out) == 8


def test_llama3_rope_config_round_trips(tmp_path: Path) -> None:
    out = build_demo_model("tiny", tmp_path / "l3", arch="llama3", max_position_embeddings=8192)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(out), local_files_only=True)
    rope = rope_parameters(cfg)
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert (rope["low_freq_factor"], rope["high_freq_factor"]) == (1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 1024
    assert rope["rope_theta"] == 10000.0
    assert len(_greedy(_hf_model(out), [BOS_ID, 100, 200, 300], 4)) == 4


def test_tiny_long_context(tiny_long_model_dir: Path) -> None:
    assert load_hf_config(tiny_long_model_dir).max_position_embeddings == 32768
    assert load_tokenizer(tiny_long_model_dir).model_max_length == 32768


def test_build_is_deterministic(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_demo_model("tiny", tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    other = build_demo_model("tiny", tmp_path / "seed1", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_sharded_save_matches_single_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    sharded = build_demo_model("tiny", tmp_path / "sharded", shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    assert len(safetensors_files(sharded)) > 1 and has_model(sharded)
    single = dict(iter_safetensors(tiny_model_dir))
    names = [name for name, _ in iter_safetensors(sharded)]
    assert len(names) == len(set(names))  # every tensor yielded exactly once
    split = dict(iter_safetensors(sharded))
    assert split.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(split[name], tensor), name
    # transformers reads the sharded dir to the same model
    ids = [BOS_ID, 10, 20, 30, 40]
    assert _greedy(_hf_model(sharded), ids, 6) == _greedy(_hf_model(tiny_model_dir), ids, 6)


def test_rebuild_replaces_previous_weights(tmp_path: Path) -> None:
    out = build_demo_model("tiny", tmp_path / "m", shard_size="2MB")
    build_demo_model("tiny", out)
    assert (out / "model.safetensors").is_file()
    assert not (out / "model.safetensors.index.json").exists()
    assert not list(out.glob("model-*.safetensors"))


def test_missing_weights_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    assert not has_model(empty)
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json"):
        list(iter_safetensors(empty))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(iter_safetensors(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(tmp_path)
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (empty / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        list(iter_safetensors(empty))
    assert has_model(tiny_model_dir)


def test_chat_template_two_turns(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Is the backup done?"},
        {"role": "assistant", "content": "Yes, at 03:12."},
        {"role": "user", "content": "Restore it."},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|>"
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nIs the backup done?<|im_end|>\n"
        "<|im_start|>assistant\nYes, at 03:12.<|im_end|>\n"
        "<|im_start|>user\nRestore it.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without.endswith("Restore it.<|im_end|>\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids.count(IM_START_ID) == 5 and ids.count(IM_END_ID) == 4
    assert tok.decode(ids) == text


def test_tokenizer_round_trips_corpus(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    corpus = corpus_text()
    samples = [corpus[i : i + 700] for i in range(0, len(corpus), len(corpus) // 17)]
    samples += ["naïve café, €2,39 — “quoted” 日本語 🙂\ttabs  and  spaces .", " x", ""]
    for text in samples:
        ids = tok(text)["input_ids"]
        assert ids[0] == BOS_ID  # plain encodes start with bos, like Llama's tokenizer
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # the corpus is what the BPE was trained on: it compresses well
    n_ids = len(tok(corpus[:20000], add_special_tokens=False)["input_ids"])
    assert n_ids < 20000 / 3


def test_init_gives_clear_argmax_and_varied_text(tiny_model_dir: Path) -> None:
    """The weight-init choice in demo.py: greedy steps are rarely near-ties and do not loop."""
    model = _hf_model(tiny_model_dir)
    gen = torch.Generator().manual_seed(7)
    gaps, rel, outs = [], [], []
    for _ in range(3):
        ids = torch.randint(5, 4096, (1, 12), generator=gen)
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=64,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=PAD_ID,
            )
        outs.append(out.sequences[0, 12:])
        for scores in out.scores:
            top = scores[0].topk(2).values
            gaps.append((top[0] - top[1]).item())
            rel.append(((top[0] - top[1]) / top[0].abs()).item())
        assert all(torch.isfinite(s).all() for s in out.scores)
    gaps_t, rel_t = torch.tensor(gaps), torch.tensor(rel)
    assert gaps_t.median() > 0.1  # measured ~0.3 (HF's std-0.02 init: ~0.04)
    assert (rel_t > 1e-3).float().mean() > 0.95  # measured ~0.99
    for seq in outs:
        assert seq.unique().numel() > 40  # of 64; HF's init collapses into 1-2 token loops


def test_cli_builds_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="appliance")
    add_demo_model_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "demo-model",
            "--shape",
            "tiny",
            "--arch",
            "qwen2",
            "--out",
            str(tmp_path / "m"),
            "--seed",
            "3",
            "--max-position-embeddings",
            "1024",
        ]
    )
    assert args.func is demo_model_command
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "training tokenizer" in printed and "writing safetensors" in printed
    assert printed.lstrip().startswith("[")  # elapsed time on every line
    cfg = load_hf_config(tmp_path / "m")
    assert cfg.model_type == "qwen2" and cfg.max_position_embeddings == 1024
    with pytest.raises(SystemExit):
        parser.parse_args(["demo-model", "--shape", "huge", "--out", "x"])


def test_rejects_unknown_shape_and_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shape"):
        build_demo_model("huge", tmp_path)
    with pytest.raises(ValueError, match="arch"):
        build_demo_model("tiny", tmp_path, arch="gpt2")


@pytest.mark.slow
def test_small_has_smollm_shape(tmp_path: Path) -> None:
    messages: list[str] = []
    out = build_demo_model("small", tmp_path / "small", progress=messages.append)
    assert any("30 layers" in m for m in messages)
    cfg = load_hf_config(out)
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (576, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.intermediate_size == 1536 and cfg.max_position_embeddings == 2048
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings is True
    assert len(load_tokenizer(out)) == 8192
    tensors = dict(iter_safetensors(out))
    assert "lm_head.weight" not in tensors
    emb = tensors["model.embed_tokens.weight"]
    assert emb.dtype == torch.bfloat16 and emb.shape == (49152, 576)
    assert emb[8192:].abs().max() == 0  # padding rows: never the greedy argmax
    n_params = sum(t.numel() for t in tensors.values())
    assert 130e6 < n_params < 140e6  # SmolLM-135M


def test_load_tokenizer_is_autotokenizer_without_the_config_detour(tiny_model_dir: Path) -> None:
    """A generic tokenizer.json loads as the class AutoTokenizer picks, with the same ids,
    special tokens and chat template; a model-specific class still goes through AutoTokenizer."""

    from transformers import AutoTokenizer

    from appliance.models.hf_files import _generic_fast_tokenizer, load_tokenizer

    ours = load_tokenizer(tiny_model_dir)
    auto = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    assert _generic_fast_tokenizer(tiny_model_dir)
    assert type(ours) is type(auto)
    text = "Hello, world: <|im_start|>user\n 12 345 ünï"
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
        chat, tokenize=False
    )


def test_a_model_specific_tokenizer_class_is_left_to_autotokenizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import shutil

    from appliance.models.hf_files import _generic_fast_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "tokenizer_class": "LlamaTokenizer"})
    )
    assert not _generic_fast_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert not _generic_fast_tokenizer(tmp_path)


def test_the_loader_reads_config_json_as_transformers_does(
    tiny_model_dir: Path, qwen2_model_dir: Path
) -> None:
    """The engine's config is config.json's keys (no config class to import): the same
    ModelArgs and EOS ids as transformers' AutoConfig of the same directory."""
    import dataclasses

    from appliance.models.args import ModelArgs
    from appliance.models.checkpoint import open_checkpoint

    for model_dir in (tiny_model_dir, qwen2_model_dir):
        ours = open_checkpoint(model_dir).hf_config()
        theirs = load_hf_config(model_dir)
        assert not hasattr(ours, "to_dict")  # not a transformers config
        assert dataclasses.replace(ModelArgs.from_hf(ours), name="") == dataclasses.replace(
            ModelArgs.from_hf(theirs), name=""
        )
        assert ours.eos_token_id == theirs.eos_token_id
