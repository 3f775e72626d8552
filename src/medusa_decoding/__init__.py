"""medusa-decoding: Medusa multi-head speculative decoding for Hugging Face causal LMs."""

from .config import GenerationConfig, HeadsConfig, MedusaError, SamplingConfig
from .decode import GenerationStats
from .engine import GenerationOutput, MedusaModel
from .heads import MedusaHeads

__all__ = [
    "GenerationConfig", "GenerationOutput", "GenerationStats", "HeadsConfig", "MedusaError",
    "MedusaHeads", "MedusaModel", "SamplingConfig",
]
__version__ = "0.1.0"
