"""``ktransformers`` / ``python -m ktransformers.server``: load a model and serve it over HTTP.

    ktransformers --model_path ./Qwen3-30B-A3B --gguf_path ./Qwen3-30B-A3B-Q4_K_M.gguf --port 10002

Settings come from built-in defaults, then ``--config file.yaml`` (keys = flag names), then
the flags given.  A bad flag, value or path prints one ``error:`` line and exits with 2.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from collections import Counter
from pathlib import Path

from ..errors import ConfigError, KTError
from .settings import (BACKENDS, DEFAULT_CHUNK_SIZE, DEFAULT_DATA_DIR, DEFAULT_POOL_TOKENS, Settings, coerce,
                       load_config_file, parse_bool)

log = logging.getLogger("ktransformers.server")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message by default)
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _bool(v: str) -> bool:
    try:
        return parse_bool(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    S = argparse.SUPPRESS
    p = _Parser(prog="ktransformers", argument_default=S,
                description="Serve a (MoE) model with OpenAI-, Ollama- and Assistants-compatible HTTP APIs.")
    g = p.add_argument_group("model")
    g.add_argument("--model_path", "--model_dir", dest="model_path",
                   help="folder with config.json + tokenizer (+ safetensors weights)")
    g.add_argument("--gguf_path", help="GGUF weights: a .gguf file or a folder of (split) .gguf files")
    g.add_argument("--mmproj", metavar="PATH", help="llama.cpp's vision-tower GGUF (mmproj-*.gguf) of the "
                                                    "--gguf_path vision-language model (Qwen3-VL-MoE)")
    g.add_argument("--optimize_config_path", help="YAML rule file (default: the shipped rules for the architecture)")
    g.add_argument("--lora_path", help="LoRA adapter folder (PEFT format, e.g. from python -m ktransformers.sft)")
    g.add_argument("--chat_template", metavar="NAME|FILE",
                   help="chat template instead of the model's own: a Jinja file, or a name (chatml, gemma, llama3, "
                        "or a template the GGUF names as tokenizer.chat_template.NAME)")
    g.add_argument("--model_name", help="name clients use for the model (default: from the folder/file name)")
    g.add_argument("--device", help="device for modules no rule places (default: cuda:0 if available, else cpu)")
    g.add_argument("--device_map", help="rewrite the rule file's devices, e.g. cuda=cpu (a GPU rule file on a CPU)")
    g.add_argument("--cpu_infer", type=int, help="threads of the CPU kernels (default: physical cores); torch gets the cores they leave")
    g.add_argument("--cache_lens", type=int,
                   help="KV cache in tokens: balance_serve: shared by all running requests (one request's "
                        "prompt + answer must fit) [the model's max positions, at most "
                        f"{DEFAULT_POOL_TOKENS}]; ktransformers: the context of a request [the model's max positions]")
    g.add_argument("--chunk_size", type=int,
                   help="balance_serve: tokens per engine step, decodes + prefill chunks "
                        f"[{DEFAULT_CHUNK_SIZE['balance_serve']}]; ktransformers: prompt tokens per prefill step "
                        f"[{DEFAULT_CHUNK_SIZE['ktransformers']}]")
    g.add_argument("--check_tensors", type=_bool, nargs="?", const=True,
                   help="read every weight once at start and refuse NaN/Inf (as llama.cpp's flag)")
    g = p.add_argument_group("batching (--backend_type balance_serve)")
    g.add_argument("--backend_type", choices=list(BACKENDS),
                   help="balance_serve: continuous batching over a shared paged KV cache [default]; "
                        "ktransformers: one request at a time on a static cache, for models the batch runner "
                        "cannot page (linear-attention layers) and for comparison")
    g.add_argument("--max_batch_size", type=int, help="requests decoded together; more wait in the queue [8]")
    g.add_argument("--page_size", type=int, help="tokens per KV page [64]")
    g.add_argument("--prefix_cache_ram_gb", type=float,
                   help="host RAM for evicted prefix-cache pages, GiB (0 = only the device pool) [0]")
    g.add_argument("--prefix_cache_dir", help="folder for the on-disk prefix cache (survives restarts)")
    g.add_argument("--prefix_cache_disk_gb", type=float, help="disk budget of --prefix_cache_dir, GiB [0]")
    g = p.add_argument_group("generation defaults (a request's own values win)")
    g.add_argument("--max_new_tokens", type=int, help="answer length when the request gives none [1024]")
    g.add_argument("--temperature", type=float,
                   help="default temperature (0 = greedy) [model's generation_config, else 0]")
    g.add_argument("--top_p", type=float, help="default top_p [model's generation_config, else 1.0]")
    g.add_argument("--top_k", type=int, help="default top_k (0 = off) [model's generation_config, else 0]")
    g.add_argument("--repetition_penalty", type=float, help="default repetition penalty [1.0]")
    g.add_argument("--force_think", type=_bool, nargs="?", const=True,
                   help="start every chat answer with '<think>' (reasoning models whose template does not)")
    g.add_argument("--speculative", metavar="ngram|draft:PATH",
                   help="speculative decoding, the same answers: ngram = prompt lookup, draft:PATH = a smaller model "
                        "of the same tokenizer; the single-request engine (--backend_type ktransformers) guesses, "
                        "the batching engine decodes plainly (docs/speculative.md) [off]")
    g.add_argument("--draft_max", type=int, help="most guessed tokens per speculative step, 1-32 [8]")
    g = p.add_argument_group("server")
    g.add_argument("--host", help="address to bind [127.0.0.1: this machine only]")
    g.add_argument("--port", type=int, help="port [10002]")
    g.add_argument("--api_key", help="require 'Authorization: Bearer <key>' on every route except GET /health "
                                     "(visible in ps: prefer --api_key_file or $KT_API_KEY)")
    g.add_argument("--api_key_file", help="read the API key from this file (first line)")
    g.add_argument("--allowed_hosts", help="comma-separated Host names served besides localhost, 127.0.0.1, [::1] "
                                           "and --host ('*': any)")
    g.add_argument("--cors_origins", help="comma-separated origins (http://host:port) whose web pages may call "
                                          "the API; others' cross-site requests get 403")
    g.add_argument("--web", type=_bool, nargs="?", const=True, help="serve the chat page at /web")
    g.add_argument("--data_dir", help=f"SQLite database (Assistants API) and logs [{DEFAULT_DATA_DIR}]")
    g.add_argument("--database_url", metavar="postgresql://USER@HOST[:PORT]/DB",
                   help="keep Conversations, Responses and Assistants in this PostgreSQL database, shared by "
                        "several servers (pip install 'ktransformers[scale-out]'; the password from "
                        "$PGPASSWORD or ~/.pgpass keeps it out of ps) [SQLite in --data_dir]")
    g.add_argument("--max_queue", type=int, help="requests that may wait for the engine; more get 503 [16]")
    g.add_argument("--max_body_mb", type=float, help="largest request body accepted, in MiB [16]")
    g.add_argument("--max_images", type=int, help="images one request may carry (vision-language models) [4]")
    g.add_argument("--max_image_mb", type=float, help="largest encoded image, in MiB [20]")
    g.add_argument("--max_image_pixels", type=int, help="most pixels of one image, checked before decoding [16777216]")
    g.add_argument("--allow_local_images", type=_bool, nargs="?", const=True,
                   help="accept file:// image URLs, read from this server's disk [off]")
    g.add_argument("--log_level", choices=["debug", "info", "warning", "error"], help="[info]")
    g.add_argument("--config", dest="config", help="YAML file of settings (keys = flag names); flags override it")
    return p


def parse_settings(argv: list[str] | None = None) -> Settings:
    ns = vars(build_parser().parse_args(argv))
    cfg_file = ns.pop("config", None)
    values = load_config_file(cfg_file) if cfg_file else {}
    values.update(ns)
    return coerce(Settings().replace(**values)).resolve_api_key().validate().validate_paths()


def _check_port(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot resolve ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ConfigError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None


def _model_info(settings: Settings, model, source, load_seconds: float) -> dict:
    weights = Path(settings.gguf_path or settings.model_path)
    files = [weights] if weights.is_file() else [p for p in weights.glob("*") if p.suffix in (".gguf", ".safetensors")]
    size = sum(p.stat().st_size for p in files if p.is_file())
    from .model_info import parameter_size, stored_parameter_count

    n_params = stored_parameter_count(source, model)  # as stored: injected operators hold buffers
    quant = ""
    if hasattr(source, "tensor_info"):
        meta = getattr(source, "metadata", {}) or {}
        from ..weights.ggml_types import FILE_TYPE_NAMES

        quant = FILE_TYPE_NAMES.get(meta.get("general.file_type"), "")
        if not quant:  # the most common type among the matrices
            try:
                counts = Counter(t for _, t, shape, _ in source.tensor_info() if len(shape) > 1)
                quant = counts.most_common(1)[0][0] if counts else ""
            except Exception:
                quant = ""
    else:
        quant = str(getattr(model.config, "dtype", "") or "").replace("torch.", "").upper()
    return {"family": getattr(model.config, "model_type", ""),
            "format": "gguf" if settings.gguf_path else "safetensors",
            "size": size, "parameter_count": n_params,
            "parameter_size": parameter_size(n_params),
            "quantization": quant, "path": str(weights), "load_seconds": load_seconds}


def _sampling_defaults(settings: Settings, model):
    from .engine import SamplingDefaults

    gc = getattr(model, "generation_config", None)
    sample = bool(getattr(gc, "do_sample", False)) if gc is not None else False

    def pick(flag, attr, fallback):
        if flag is not None:
            return flag
        v = getattr(gc, attr, None) if (gc is not None and sample) else None
        return v if v is not None else fallback

    return SamplingDefaults(temperature=float(pick(settings.temperature, "temperature", 0.0)),
                            top_p=float(pick(settings.top_p, "top_p", 1.0)),
                            top_k=int(pick(settings.top_k, "top_k", 0)),
                            max_new_tokens=settings.max_new_tokens,
                            repetition_penalty=float(settings.repetition_penalty or 1.0))


def _max_positions(config) -> int:
    """The model's own context (max_position_embeddings; 4096 where the config names none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VL model's text part
    return int(getattr(text, "max_position_embeddings", None) or 4096)


def planned_context(settings: Settings, config) -> int:
    """The tokens whose KV cache the memory plan counts before a weight is read: the server's (the
    batching engine's page pool, else ``--cache_lens`` or the model's max positions), at most the
    model's max positions, the longest one sequence the plan sizes (a larger pool is not refused)."""
    max_pos = _max_positions(config)
    if settings.backend_type == "balance_serve":
        from .batch_engine import pool_tokens

        return min(pool_tokens(settings, max_pos), max_pos)
    return min(settings.cache_lens or max_pos, max_pos)


def build_engine(settings: Settings):
    """Load the model, tokenizer and Generator named by ``settings`` into an :class:`Engine`."""
    from ..generation import Generator
    from ..loading import load_for_generation
    from .engine import Engine

    from ..operators.cpu_threads import use_threads

    use_threads(settings.cpu_infer)
    t0 = time.perf_counter()
    from ..weights import open_weights_arg

    loaded = load_for_generation(open_weights_arg(settings.gguf_path or settings.model_path, settings.mmproj),
                                 settings.model_path,
                                 settings.optimize_config_path, device=settings.device,
                                 device_map=settings.device_map, allow_unmatched=True, log=log.info,
                                 check_tensors=settings.check_tensors, lora=settings.lora_path,
                                 chat_template=settings.chat_template,
                                 context=lambda config: planned_context(settings, config))
    model, tokenizer, source = loaded.model, loaded.tokenizer, loaded.source
    from ..multimodal.chat import image_support
    from ..weights.model_config import weights_folder

    images = image_support(model.config, tokenizer, settings.model_path or weights_folder(source),
                           settings.image_limits(), source=source)
    if not getattr(tokenizer, "chat_template", None):
        from ..util.chat_templates import ADD_TEMPLATE_HINT

        log.warning("the model has no chat template: chat requests are continued as plain text; %s",
                    ADD_TEMPLATE_HINT)
    load_s = time.perf_counter() - t0
    max_pos = _max_positions(model.config)
    name = settings.model_name or settings.default_model_name()
    common = dict(model_name=name, defaults=_sampling_defaults(settings, model), max_queue=settings.max_queue,
                  model_info=_model_info(settings, model, source, load_s))
    if settings.backend_type == "balance_serve":
        from ..generation.paged import NotPageable
        from .batch_engine import build_batch_engine

        if settings.speculative:
            log.warning("--speculative %s: the batching engine decodes plainly (the same answers); "
                        "--backend_type ktransformers speculates", settings.speculative)

        try:
            return build_batch_engine(settings, model, tokenizer, max_pos, images=images, **common)
        except NotPageable as e:  # a layer the paged cache cannot hold (linear attention, sinks)
            log.warning("continuous batching is not available for this model (%s); serving one request "
                        "at a time (--backend_type ktransformers)", e)
    max_context = settings.cache_lens or max_pos
    from ..generation.speculative import parse_speculative
    from ..loading import load_draft_model

    generator = Generator(model, tokenizer, chunk_size=settings.prefill_chunk, max_cache_len=max_context,
                          speculative=parse_speculative(settings.speculative, settings.draft_max)[0],
                          draft_max=settings.draft_max,
                          draft_model=load_draft_model(settings.speculative, settings.draft_max, tokenizer,
                                                       device=settings.device, device_map=settings.device_map,
                                                       log=log.info))
    return Engine(generator, tokenizer, max_context=max_context, images=images, **common)


def _setup_logging(settings: Settings) -> Path:
    logs = Path(settings.data_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    level = getattr(logging, settings.log_level.upper(), logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger("ktransformers")
    root.setLevel(level)
    from .db import private_file

    fh = logging.FileHandler(private_file(logs / "server.log"))
    fh.setFormatter(fmt)
    sh = logging.StreamHandler()
    sh.setFormatter(fmt)
    root.handlers[:] = [fh, sh]
    return logs / "server.log"


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
        _check_port(settings.host, settings.port)
        try:
            Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--data_dir {settings.data_dir}: cannot create it ({e.strerror})") from None
        log_file = _setup_logging(settings)
        from .db import Database

        database = Database(settings.data_dir, url=settings.database_url)  # a bad URL fails before the model loads
        log.info("database %s", database.where)
        log.info("data dir %s (%slogs in %s)", Path(settings.data_dir).resolve(),
                 "" if settings.database_url else "database, ", log_file)
        log.info("loading model ...")
        engine = build_engine(settings)
    except KTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from .app import create_app

    app = create_app(engine, settings, db=database)
    log.info("model '%s' loaded in %.1fs; context %d tokens", engine.model_name, engine.load_seconds,
             engine.max_context)
    url = f"http://{settings.host}:{settings.port}"
    log.info("serving on %s  (OpenAI: %s/v1  Ollama: %s/api%s)%s", url, url, url,
             f"  web: {url}/web" if settings.web else "", "  [API key required]" if settings.api_key else "")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
