"""Server settings: built-in defaults < ``--config`` YAML file < command-line flags."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError

DEFAULT_DATA_DIR = "./.ktransformers-data"

#: --backend_type values: continuous batching over a shared paged KV pool (the default), or one
#: request at a time on a static cache (for models the batch runner cannot page, e.g. linear attention)
BACKENDS = ("balance_serve", "ktransformers")
#: --chunk_size default per backend: batching shares each step's budget between decodes and prefill,
#: so a smaller budget keeps running streams moving while a long prompt is prefilled
DEFAULT_CHUNK_SIZE = {"balance_serve": 512, "ktransformers": 8192}
#: --max_body_mb bounds: 1 KiB .. 1 TiB
MAX_BODY_MB_RANGE = (1 / 1024, 1024.0 * 1024)
#: --cache_lens default for batching when not given: the model's max positions, at most this many
#: tokens (the pool is allocated once for all requests)
DEFAULT_POOL_TOKENS = 32768


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 10002
    model_path: str | None = None
    gguf_path: str | None = None
    mmproj: str | None = None  # llama.cpp's vision-tower GGUF beside a vision-language gguf_path
    optimize_config_path: str | None = None
    lora_path: str | None = None  # LoRA adapter folder (PEFT format) applied to the model
    chat_template: str | None = None  # a Jinja file or template name replacing the model's own
    model_name: str | None = None
    cpu_infer: int | None = None
    max_new_tokens: int = 1024
    cache_lens: int | None = None
    chunk_size: int | None = None  # DEFAULT_CHUNK_SIZE[backend_type] when not given
    backend_type: str = "balance_serve"
    max_batch_size: int = 8
    page_size: int = 64
    prefix_cache_ram_gb: float = 0.0
    prefix_cache_dir: str | None = None
    prefix_cache_disk_gb: float = 0.0
    check_tensors: bool = False
    api_key: str | None = None
    api_key_file: str | None = None
    allowed_hosts: str | None = None  # comma-separated, beside the loopback names and the bind address
    cors_origins: str | None = None  # comma-separated origins whose pages may call the API
    web: bool = False
    data_dir: str = DEFAULT_DATA_DIR
    database_url: str | None = None  # PostgreSQL shared by several servers; None: SQLite in data_dir
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    force_think: bool = False  # every chat answer starts inside <think> (reasoning models)
    speculative: str | None = None  # ngram | draft:PATH (the single-request engine; docs/speculative.md)
    draft_max: int = 8
    max_queue: int = 16
    max_body_mb: float = 16.0
    max_images: int = 4  # images one request may carry (vision-language models)
    max_image_mb: float = 20.0  # encoded size of one image, MiB
    max_image_pixels: int = 4096 * 4096  # pixels of one image, read from its header before decoding
    allow_local_images: bool = False  # file:// image URLs read from the server's own disk
    device: str | None = None
    device_map: str | None = None
    log_level: str = "info"

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def replace(self, **kw) -> "Settings":
        return dataclasses.replace(self, **kw)

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per step (single-request) / tokens per engine step (batching)."""
        return self.chunk_size or DEFAULT_CHUNK_SIZE[self.backend_type]

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    def image_limits(self):
        from ..multimodal.images import ImageLimits

        return ImageLimits(max_images=self.max_images, max_bytes=int(self.max_image_mb * 1024 * 1024),
                           max_pixels=self.max_image_pixels, allow_local_files=bool(self.allow_local_images))

    def host_allow_list(self) -> set[str] | None:
        """Host names requests may carry; None when any is fine (all interfaces, or '*')."""
        extra = _split(self.allowed_hosts)
        if "*" in extra or (self.host in ("0.0.0.0", "::", "") and not extra):
            return None
        bind = self.host.lower()
        names = {"localhost", "127.0.0.1", "[::1]", bind if ":" not in bind else f"[{bind}]"}
        return names | {h.lower() for h in extra}

    def cors_origin_list(self) -> list[str]:
        return [o.rstrip("/") for o in _split(self.cors_origins)]

    def resolve_api_key(self, environ=None) -> "Settings":
        """The key from --api_key, else --api_key_file, else $KT_API_KEY (flags show in ``ps``)."""
        import os

        environ = os.environ if environ is None else environ
        if self.api_key is not None:
            return self
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"--api_key_file {self.api_key_file}: cannot read it "
                                  f"({getattr(e, 'strerror', None) or e})") from None
            if not key:
                raise ConfigError(f"--api_key_file {self.api_key_file}: the file is empty")
            return self.replace(api_key=key)
        if environ.get("KT_API_KEY"):
            return self.replace(api_key=environ["KT_API_KEY"].strip())
        return self

    def validate(self) -> "Settings":
        """Raise ConfigError (one line) on a value the server cannot start with."""
        if not (0 < self.port < 65536):
            raise ConfigError(f"--port {self.port}: must be 1..65535")
        for f in fields(self):  # nan / inf pass every comparison below
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"--{f.name} {v}: must be a finite number")
        for name in ("max_new_tokens", "chunk_size", "max_body_mb", "max_batch_size", "page_size"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"--{name} {getattr(self, name)}: must be positive")
        if not (MAX_BODY_MB_RANGE[0] <= self.max_body_mb <= MAX_BODY_MB_RANGE[1]):
            raise ConfigError(f"--max_body_mb {self.max_body_mb}: must be within {MAX_BODY_MB_RANGE[0]} (1 KiB).."
                              f"{MAX_BODY_MB_RANGE[1]} (1 TiB)")
        if self.backend_type not in BACKENDS:
            raise ConfigError(f"--backend_type {self.backend_type}: must be one of {', '.join(BACKENDS)}")
        for name in ("prefix_cache_ram_gb", "prefix_cache_disk_gb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} {getattr(self, name)}: must be 0 (off) or more")
        if self.prefix_cache_disk_gb > 0 and not self.prefix_cache_dir:
            raise ConfigError(f"--prefix_cache_disk_gb {self.prefix_cache_disk_gb}: needs --prefix_cache_dir")
        if self.prefix_cache_dir and Path(self.prefix_cache_dir).exists() and not Path(self.prefix_cache_dir).is_dir():
            raise ConfigError(f"--prefix_cache_dir {self.prefix_cache_dir}: exists and is not a folder")
        if self.cpu_infer is not None and self.cpu_infer < 1:
            raise ConfigError(f"--cpu_infer {self.cpu_infer}: must be at least 1")
        from ..generation.speculative import parse_speculative

        parse_speculative(self.speculative, self.draft_max)
        if self.cache_lens is not None and self.cache_lens < 16:
            raise ConfigError(f"--cache_lens {self.cache_lens}: must be at least 16 tokens")
        if (self.backend_type == "balance_serve" and self.cache_lens is not None
                and self.cache_lens < self.page_size):
            raise ConfigError(f"--cache_lens {self.cache_lens}: must hold at least one page (--page_size "
                              f"{self.page_size})")
        if self.max_queue < 0:
            raise ConfigError(f"--max_queue {self.max_queue}: must be 0 or more")
        if self.max_images < 0:
            raise ConfigError(f"--max_images {self.max_images}: must be 0 (images refused) or more")
        if self.max_image_pixels <= 0:
            raise ConfigError(f"--max_image_pixels {self.max_image_pixels}: must be positive")
        if not (0 < self.max_image_mb <= MAX_BODY_MB_RANGE[1]):
            raise ConfigError(f"--max_image_mb {self.max_image_mb}: must be positive, at most {MAX_BODY_MB_RANGE[1]} (1 TiB)")
        if self.temperature is not None and not (0 <= self.temperature <= 2):
            raise ConfigError(f"--temperature {self.temperature}: must be within 0..2")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise ConfigError(f"--top_p {self.top_p}: must be within (0, 1]")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ConfigError(f"--repetition_penalty {self.repetition_penalty}: must be positive (1 = off)")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"--top_k {self.top_k}: must be 0 (off) or more")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api_key: must not be empty")
        if self.database_url:
            from .db import parse_database_url

            parse_database_url(self.database_url)  # the form only: connecting is tried at start
        for o in self.cors_origin_list():
            if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
                raise ConfigError(f"--cors_origins {o}: an origin is scheme://host[:port], e.g. http://localhost:3000")
        return self

    def validate_paths(self) -> "Settings":
        if not self.model_path and not self.gguf_path:
            raise ConfigError("no model: pass --model_path (folder with config.json + tokenizer"
                              " [+ safetensors]) and/or --gguf_path (a .gguf file or folder)")
        if self.model_path and not Path(self.model_path).exists():
            raise ConfigError(f"--model_path {self.model_path}: no such file or directory")
        if self.gguf_path and not Path(self.gguf_path).exists():
            raise ConfigError(f"--gguf_path {self.gguf_path}: no such file or directory")
        if self.mmproj and not self.gguf_path:
            from ..weights import mmproj_without_gguf

            raise mmproj_without_gguf(self.mmproj, self.model_path)
        if self.mmproj and not Path(self.mmproj).is_file():
            raise ConfigError(f"--mmproj {self.mmproj}: no such file")
        if self.optimize_config_path and not Path(self.optimize_config_path).is_file():
            raise ConfigError(f"--optimize_config_path {self.optimize_config_path}: no such file")
        if self.lora_path and not Path(self.lora_path).is_dir():
            raise ConfigError(f"--lora_path {self.lora_path}: no such folder")
        return self

    def default_model_name(self) -> str:
        import re

        p = Path(self.gguf_path or self.model_path or "model")
        name = p.stem if p.is_file() or p.suffix in (".gguf", ".safetensors") else p.name
        if p.suffix == ".safetensors" and p.parent.name:
            name = p.parent.name
        return re.sub(r"-\d{5}-of-\d{5}$", "", name) or "model"


def load_config_file(path: str) -> dict[str, Any]:
    """Flat YAML mapping of setting names (same as the flags, without dashes) to values."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: must be a mapping of setting: value")
    known = set(Settings.keys())
    out = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key not in known:
            raise ConfigError(f"--config {path}: unknown setting '{k}' (known: {', '.join(sorted(known))})")
        out[key] = v
    return out


def coerce(settings: Settings) -> Settings:
    """Check/convert the types of values that came from YAML."""
    kw = {}
    for f in fields(Settings):
        v = getattr(settings, f.name)
        if v is None:
            continue
        t = str(f.type)
        try:
            if t.startswith("int"):
                if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                    raise ValueError
                kw[f.name] = int(v)
            elif t.startswith("float"):
                if isinstance(v, bool):
                    raise ValueError
                kw[f.name] = float(v)
            elif t.startswith("bool"):
                kw[f.name] = parse_bool(v)
            elif t.startswith("str"):
                if isinstance(v, (dict, list)):
                    raise ValueError
                kw[f.name] = str(v)
        except (TypeError, ValueError):
            raise ConfigError(f"setting '{f.name}': {v!r} is not a valid {t.split(' ')[0]}") from None
    return settings.replace(**kw)


def _split(value: str | None) -> list[str]:
    return [x.strip() for x in (value or "").split(",") if x.strip()]


def parse_bool(v) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {v!r}")
