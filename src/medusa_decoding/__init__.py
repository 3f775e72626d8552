"""medusa-decoding: Medusa multi-head speculative decoding for Hugging Face causal LMs."""

from .config import DrafterKind, GenerationConfig, HeadsConfig, MedusaError, NgramConfig, SamplingConfig
from .engine import Decoder, GenerationOutput, GenerationStats, MedusaModel, Request
from .heads import MedusaHeads
from .spec import DecodeSpec

__all__ = [
    "DecodeSpec", "Decoder", "DrafterKind", "GenerationConfig", "GenerationOutput", "GenerationStats", "HeadsConfig",
    "MedusaError", "MedusaHeads", "MedusaModel", "NgramConfig", "Request", "SamplingConfig",
]
__version__ = "0.1.0"
