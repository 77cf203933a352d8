"""HTTP server: OpenAI-, Ollama- and Assistants-compatible APIs around one loaded model.

``python -m ktransformers.server --model_path … [--gguf_path …]`` or, in code,
``create_app(Engine(Generator(model, tokenizer), tokenizer, model_name=…, max_context=…), Settings())``.
"""

from .app import create_app
from .engine import Engine, EngineStream, GenerationRequest, QueueFull, SamplingDefaults
from .settings import Settings

__all__ = ["Engine", "EngineStream", "GenerationRequest", "QueueFull", "SamplingDefaults", "Settings", "create_app"]
