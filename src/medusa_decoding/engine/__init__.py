"""The engine: the decode loop (decoder.py), how much to speculate under load (policy.py) and the
Python API (api.py)."""

from .api import GenerationOutput, MedusaModel, TextStream, make_backend
from .decoder import ROOT_ONLY, Decoder, GenerationStats, Method, Request, RowOutput, Source
from .policy import AdaptiveSpeculation, FixedSpeculation

__all__ = ["ROOT_ONLY", "AdaptiveSpeculation", "Decoder", "FixedSpeculation", "GenerationOutput", "GenerationStats",
           "MedusaModel", "Method", "Request", "RowOutput", "Source", "TextStream", "make_backend"]
