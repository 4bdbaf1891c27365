"""The [lora] config, the PEFT adapter reader and its refusals (each names the field and the
limit), and the scheduler's slot table (LRU over idle adapters, never a busy one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from appliance.config import ConfigError, load_config
from appliance.core.lora_slots import LoraSlotTable
from appliance.models.args import ModelArgs
from appliance.models.peft_adapter import AdapterError, read_adapter
from tests.lora_fixtures import save_random_adapter


def tiny_args(model_dir: Path) -> ModelArgs:
    from transformers import AutoConfig

    return ModelArgs.from_hf(AutoConfig.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "a", seed=3)


def test_config_section_and_bad_values_name_their_key() -> None:
    cfg = load_config(None, {"lora.adapters": {"sql": "/x"}, "lora.max_loras": 3})
    assert cfg.lora.active and cfg.lora.max_loras == 3 and cfg.lora.max_lora_rank == 16
    assert not load_config(None).lora.active
    with pytest.raises(ConfigError, match=r"lora\.max_loras"):
        load_config(None, {"lora.max_loras": 0})
    with pytest.raises(ConfigError, match=r"lora\.max_lora_rank"):
        load_config(None, {"lora.max_lora_rank": "big"})
    with pytest.raises(ConfigError, match=r"unknown field `colour` - at `\$\.lora`"):
        load_config(None, {"lora.colour": 1})


def test_reader_gives_peft_factors_with_the_scaling_folded_in(
    tiny_model_dir: Path, adapter_dir: Path
) -> None:
    adapter = read_adapter("a", adapter_dir, tiny_args(tiny_model_dir), max_rank=16)
    assert adapter.rank == 8 and adapter.alpha == 16.0
    assert adapter.target_modules == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    layer = peft_model.base_model.model.model.layers[1]
    q = layer.self_attn.q_proj
    factors = adapter.modules[(1, "q_proj")]
    assert torch.equal(factors.a, q.lora_A["default"].weight)
    scaling = q.scaling["default"]
    assert scaling == 2.0
    torch.testing.assert_close(factors.b, q.lora_B["default"].weight * scaling)
    # The delta peft adds equals the one the factors give.
    x = torch.randn(3, q.in_features)
    expected = q(x) - q.base_layer(x)
    torch.testing.assert_close(x @ factors.a.T @ factors.b.T, expected, rtol=1e-4, atol=1e-5)


def test_rank_over_max_lora_rank_is_refused(tiny_model_dir: Path, adapter_dir: Path) -> None:
    with pytest.raises(AdapterError, match=r"r 8 exceeds lora\.max_lora_rank 4"):
        read_adapter("a", adapter_dir, tiny_args(tiny_model_dir), max_rank=4)


def test_target_module_the_model_lacks_is_refused(
    tiny_model_dir: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    raw = json.loads((adapter_dir / "adapter_config.json").read_text())
    raw["target_modules"] = ["q_proj", "lm_head"]
    (bad / "adapter_config.json").write_text(json.dumps(raw))
    (bad / "adapter_model.safetensors").write_bytes(
        (adapter_dir / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match=r"target_modules \['lm_head'\]"):
        read_adapter("bad", bad, tiny_args(tiny_model_dir), max_rank=16)
    # A tensor for a layer the base model does not have.
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
    tensors[key.replace("layers.0.", "layers.99.")] = tensors[key].clone()
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    raw["target_modules"] = ["q_proj"]
    (bad / "adapter_config.json").write_text(json.dumps(raw))
    with pytest.raises(AdapterError, match=r"layer 99, the base model has 4 layers"):
        read_adapter("bad", bad, tiny_args(tiny_model_dir), max_rank=16)


def test_adapter_of_a_differently_shaped_base_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An adapter peft trained on a base with another intermediate size: the MLP factors'
    shapes differ from this base's, and the message names the tensor and the features."""
    args = tiny_args(tiny_model_dir)
    other = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size * 2,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
    )
    LlamaForCausalLM(other).save_pretrained(tmp_path / "other-base")
    adapter = save_random_adapter(tmp_path / "other-base", tmp_path / "other", seed=4)
    with pytest.raises(AdapterError, match=r"gate_proj gives \d+ output features|down_proj takes"):
        read_adapter("other", adapter, args, max_rank=16)


def test_missing_files_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter("x", tmp_path, tiny_args(tiny_model_dir), max_rank=16)


def test_slot_table_evicts_the_least_recently_used_idle_adapter() -> None:
    table = LoraSlotTable(2)
    assert table.acquire("a", set()) and table.acquire("b", set())
    assert table.slot_of("a") == 0 and table.slot_of("b") == 1 and table.slot_of("") == -1
    assert table.acquire("a", set())  # a used again: b is now the least recent
    assert table.acquire("c", set())
    assert table.slot_of("c") == 1 and table.slot_of("b") == -1
    # Every slot busy: no slot for d, nothing evicted.
    assert not table.acquire("d", {"a", "c"})
    assert table.resident() == ["a", "c"]
    # One idle: it goes, even when it is the most recently used.
    assert table.acquire("d", {"a"})
    assert table.resident() == ["a", "d"]
    table.release("a")
    assert table.resident() == ["d"] and table.acquire("e", {"d"})


@pytest.mark.parametrize(
    ("num_slots", "row_slots"),
    [
        (4, [0, 0, 0]),  # one adapter for every row: its slices
        (4, [2, -1, 0, 2, 3, -1]),  # several, small pool: every slot's update, masked
        (12, [11, -1, 0, 11, 5]),  # several, large pool: the per-slot segment loop
    ],
)
def test_lora_matmul_adds_each_rows_own_update(num_slots: int, row_slots: list[int]) -> None:
    """Against a per-row torch reference: row i gets x_i A_s^T B_s^T of its slot s (none for
    -1), whatever path the step takes."""
    from appliance.layers.lora import LoraBatch, LoraFactors, LoraMatmul, TorchLoraUpdate

    torch.manual_seed(0)
    width, d_in, d_out = 6, 10, 7
    weight = torch.randn(d_out, d_in)
    a = torch.randn(num_slots * width, d_in)
    b = torch.randn(d_out, num_slots * width)
    batch = LoraBatch(num_slots)
    factors = LoraFactors(a, b.T.contiguous(), width, [(0, d_out)])
    lora = LoraMatmul(
        lambda x, bias: torch.nn.functional.linear(x, weight, bias),
        factors,
        batch,
        TorchLoraUpdate(),
    )
    x = torch.randn(len(row_slots), d_in)
    batch.set_rows(row_slots, torch.device("cpu"))
    got = lora(x, None)
    for i, s in enumerate(row_slots):
        ref = x[i] @ weight.T
        if s >= 0:
            ref = (
                ref + x[i] @ a[s * width : (s + 1) * width].T @ b[:, s * width : (s + 1) * width].T
            )
        torch.testing.assert_close(got[i], ref, rtol=1e-5, atol=1e-5)
    batch.set_rows([-1] * len(row_slots), torch.device("cpu"))
    torch.testing.assert_close(lora(x, None), x @ weight.T)
