"""What the offline demo models are, without building them: their shapes, architectures and
the corpus shipped with the package. No torch here: the memory planner (and through it the
console's templates screen) reads the shapes of a demo template that is not built yet."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

SHAPES = ("tiny", "small")
ARCHS = ("llama", "qwen2", "llama3")


@dataclass(frozen=True)
class DemoShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    tokenizer_vocab: int
    model_vocab: int  # >= tokenizer_vocab; the extra rows are padding, as in real checkpoints
    # A torch dtype's name ("float32"): the builder turns it into the dtype.
    dtype: str


DEMO_SHAPES: dict[str, DemoShape] = {
    "tiny": DemoShape(256, 4, 8, 2, 688, False, 4096, 4096, 4096, "float32"),
    # SmolLM-135M's shape; bf16 because its purpose is speed runs, not exactness.
    "small": DemoShape(576, 30, 9, 3, 1536, True, 2048, 8192, 49152, "bfloat16"),
}


def corpus_text() -> str:
    """The training text shipped with the package (also used by tests for round trips)."""
    return resources.files("appliance.models").joinpath("data/corpus.txt").read_text("utf-8")
