"""Text generation on an injected model: ``Generator(model, tokenizer).stream(ids, SamplingParams())``.

Used by ``python -m ktransformers.local_chat`` and by the HTTP server.
"""

from .engine import GenerationStats, Generator, StreamOutput, TokenEvent, eos_token_ids, message_text
from .sampling import Sampler, SamplingParams
from .text import IncrementalDetokenizer, StopStrings

__all__ = [
    "GenerationStats", "Generator", "IncrementalDetokenizer", "Sampler", "SamplingParams", "StopStrings",
    "StreamOutput", "TokenEvent", "eos_token_ids", "message_text",
]
