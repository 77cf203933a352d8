"""The load pipeline: from paths to a ready model, no model hub.

One sequence, in two halves every load goes through:

* :func:`plan_load`: the weights' header, the config (read once), the rules parsed once (the device
  map rewrites the parsed rules), the model on the meta device and its plan, made once, each
  weight's format decided on it from the header (``Plan.decide_formats``), with the checks that
  need no weight (unmatched rules, devices, transfer maps); ``explain`` reads the same plan
  (``plan_only``: no load follows, so the devices need not be this machine's);
* :func:`load_planned`: that plan applied (``optimize.inject(plan=)``: operators, weights, LoRA).

:func:`load_model` is the two back to back; :func:`load_for_generation` (local_chat, the server,
``ktransformers.load``, a draft model) puts the memory plan's check, the tokenizer and the
pre-flight checks between them.  Fine-tuning loads through :func:`load_model`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError, RuleError
from ..optimize.device_map import load_rules_mapped, parse_device_map
from ..generation.hf_generate import use_lean_generate
from ..optimize.inject import inject as inject_rules
from ..optimize.inject import ModelWeights, build_model, check_transfer_maps
from ..optimize.plan import Plan, check_devices_available, plan_model
from ..optimize_rules import default_rule_file
from ..weights import WeightSource, open_weights
from ..weights.model_config import load_config  # noqa: F401 - load_config is public here too
from ..util.peft_adapter import read_adapter
from .tokenizer import load_tokenizer


def inject(model, rules, weights, **kwargs):
    """:func:`ktransformers.optimize.inject` (rules -> plan -> operators -> weights), with the injected
    model's ``generate()`` decoding on the lean step that local_chat runs (``generation.hf_generate``).
    This is ``ktransformers.inject``, the entry point of a user's own script; same arguments."""
    model = inject_rules(model, rules, weights, **kwargs)
    use_lean_generate(model)
    return model


def check_memory_plan(model, plan, source, say=lambda msg: None, context: int | None = None) -> None:
    """Say what the load will hold in host and accelerator memory (``explain``'s memory plan; the KV
    cache at ``context`` tokens when one is chosen) and refuse, before any weight is read, a load
    that exceeds what the machine has available (``KT_IGNORE_MEMORY_PLAN=1`` loads anyway)."""
    from ..optimize.explain import fmt_bytes, explain_plan

    mem = explain_plan(model, plan, source, context=context).memory
    for line in mem.lines():
        say(line.strip())
    if os.environ.get("KT_IGNORE_MEMORY_PLAN", "0") != "0":
        return
    for dev, need, free in mem.short_devices():
        raise ConfigError(f"{getattr(source, 'path', source)}: the load needs {fmt_bytes(need)} on {dev} "
                          f"and it has {fmt_bytes(free)} free; place fewer modules there (--device_map, the rule "
                          f"file) or KT_IGNORE_MEMORY_PLAN=1 loads anyway")
    if mem.available is not None and mem.private > mem.available:
        raise ConfigError(
            f"{getattr(source, 'path', source)}: the load needs {fmt_bytes(mem.private)} of private memory "
            f"(copies {fmt_bytes(mem.copies)}, packed experts {fmt_bytes(mem.packed if not mem.cache_on else mem.packed_layer)}"
            + (f", KV cache at {mem.context} tokens {fmt_bytes(mem.kv_cache)}" if mem.context_chosen else "") + ") "
            f"and this machine has {fmt_bytes(mem.available)} available; the experts' llamafile backend reads the "
            f"file in place, the packed-weight cache (KT_PACKED_CACHE) maps packed copies; KT_IGNORE_MEMORY_PLAN=1 "
            f"loads anyway")


@dataclass
class PlannedLoad:
    """A load up to its plan (:func:`plan_load`), before any weight is read; :func:`load_planned` finishes it."""

    source: WeightSource | None  # None: a plan from a config alone (``plan_only``)
    config: object
    rules: object  # the rule file (path), text or rules named, or the shipped file chosen
    rule_list: list  # the rules parsed once, after the device map
    model: torch.nn.Module  # the transformers model on the meta device
    plan: Plan  # the one plan of this load
    device: str  # where modules no rule places go
    plan_only: bool = False  # made to be read (``explain``), not loaded: its devices were not checked


def plan_load(
    weights,
    model_path: str | os.PathLike | None = None,
    rules=None,
    *,
    config=None,
    dtype: torch.dtype | None = None,
    device: str | None = None,
    device_map: dict[str, str] | str | None = None,
    allow_unmatched: bool | None = None,
    check_config=None,
    log=None,
    plan_only: bool = False,
) -> PlannedLoad:
    """The first half of every load: weights header, config, rules, the model on meta, its plan.

    ``weights`` is a GGUF file/folder, a safetensors file/folder or a ``WeightSource``; ``config``
    (else read from ``model_path`` / the weights) takes ``dtype`` when given and may be refused by
    ``check_config(config)``.  ``rules`` defaults to the shipped rule file for the architecture, its
    GPU variant when ``device`` (default ``cuda:0`` where CUDA is available, else ``cpu``) is a
    CUDA device or ``device_map`` maps ``cuda`` away; the rules are parsed once and the device map
    (``{"cuda": "cpu"}`` or ``"cuda=cpu"``) rewrites the parsed rules.  The plan is made once and
    checked (a rule matching nothing unless ``allow_unmatched``, which defaults to True for the
    shipped file and False for rules the caller names; devices this machine lacks; transfer maps)
    before any weight is read.  With the weights, each op's weight formats are decided on the plan
    here, from the file's header (``Plan.decide_formats``), and the operators are handed them.

    ``plan_only``: the plan is to be read, not loaded (``python -m ktransformers.optimize explain``):
    the devices the rules name need not exist on this machine (a GPU rule file explained on a
    CPU-only one), ``weights`` may be None (the config from ``model_path``; no formats then), and
    :func:`load_planned` refuses the result.
    """
    say = log or (lambda msg: None)
    if weights is None and not plan_only:
        raise ConfigError("plan_load: no weights given (only a plan_only plan can be made from a config alone)")
    if weights is not None:
        say(f"reading {weights} ...")
    source = weights if weights is None or isinstance(weights, WeightSource) else open_weights(weights)
    if config is None:
        config = load_config(model_path, source)
    if dtype is not None:
        config.dtype = dtype
    if check_config is not None:
        check_config(config)
    dmap = parse_device_map(device_map) if isinstance(device_map, str) else (device_map or {})
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if rules is None:
        rules = default_rule_file(config, cuda=device.startswith("cuda") or _cuda_after_map(dmap))
        if allow_unmatched is None:
            allow_unmatched = True
    elif allow_unmatched is None:
        allow_unmatched = False
    rule_list = load_rules_mapped(rules, dmap)
    model = build_model(config, dtype)
    plan = plan_model(model, rule_list, device)
    unmatched = plan.unmatched_rules()
    if unmatched and not allow_unmatched:
        r = unmatched[0]
        raise RuleError(f"{r.where()}: matches no module of {type(model).__name__} ({r.describe_match()})")
    if not plan_only:
        check_devices_available(plan)
    check_transfer_maps(plan)
    if source is not None:
        plan.decide_formats(model, ModelWeights(source, model))
    return PlannedLoad(source, config, rules, rule_list, model, plan, device, plan_only)


def load_planned(planned: PlannedLoad, *, progress: bool = False, lora=None) -> torch.nn.Module:
    """The second half of every load: the plan of ``planned`` applied (operators built, weights read
    onto their devices, ``lora``'s adapter applied), ``generate()`` on the lean decode step."""
    if planned.plan_only or planned.source is None:
        raise ValueError("load_planned: this plan was made plan_only (for explain): its devices were not "
                         "checked; make it with plan_load(weights, ...) to load it")
    return inject(planned.model, planned.rule_list, planned.source, default_device=planned.device,
                  allow_unmatched=True, progress=progress, lora=lora, plan=planned.plan)


def load_model(
    weights,
    model_path: str | os.PathLike | None = None,
    rules=None,
    *,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    allow_unmatched: bool = True,
    progress: bool = False,
    device_map: dict[str, str] | str | None = None,
    config=None,
    lora=None,
    mmproj=None,
):
    """Build the model for ``weights`` (+ optional config folder), inject ``rules``, load.

    ``weights`` is a GGUF file/folder, a safetensors file/folder (its ``config.json`` is used when
    ``model_path`` is not given) or a ``WeightSource``.  ``rules`` defaults to the shipped rule
    file for the architecture (the CPU variant unless ``device`` is a CUDA device, which it is by
    default where CUDA is available).  ``device`` is where modules no rule places go;
    ``device_map`` (``{"cuda": "cpu"}`` or ``"cuda=cpu"``) rewrites the devices the rules name (see
    :mod:`ktransformers.optimize.device_map`); ``lora`` a LoRA adapter folder (PEFT format)
    applied after loading; ``mmproj`` llama.cpp's vision-tower GGUF beside a vision-language GGUF
    ``weights`` (``weights.mmproj``).  :func:`plan_load` then :func:`load_planned`.
    """
    if mmproj is not None:
        weights = open_weights(weights, mmproj=mmproj)
    planned = plan_load(weights, model_path, rules, config=config, dtype=dtype, device=device,
                        device_map=device_map, allow_unmatched=allow_unmatched)
    return load_planned(planned, progress=progress, lora=lora)


def load(weights, model_path: str | os.PathLike | None = None, rules=None, *, device: str | None = None,
         device_map: dict[str, str] | str | None = None, lora=None, chat_template: str | None = None,
         progress: bool = False):
    """``(model, tokenizer)`` for ``weights``: ``ktransformers.load("model.gguf")`` takes config,
    tokenizer and chat template from the GGUF and the shipped rules for its architecture, through
    the load sequence of local_chat and the server (:func:`load_for_generation`: plan and memory
    checked before any weight is read).  ``chat_template``: a Jinja file or template name replacing
    the model's own (see :mod:`ktransformers.util.chat_templates`)."""
    loaded = load_for_generation(weights, model_path, rules, device=device, device_map=device_map, lora=lora,
                                 chat_template=chat_template, progress=progress)
    return loaded.model, loaded.tokenizer


def _cuda_after_map(dmap: dict[str, str]) -> bool:
    """With ``cuda`` mapped away, the default rules need not be the CPU variant: the GPU file runs."""
    return any(k.startswith("cuda") for k in dmap)


@dataclass
class LoadedModel:
    """Everything a chat front end needs, from :func:`load_for_generation`."""

    model: torch.nn.Module
    tokenizer: object
    source: object
    config: object
    rules: object  # the rule file (path) or text used
    seconds: float
    #: seconds per load phase, in order (what local_chat reports; the weights may be mapped, not read)
    phases: dict = field(default_factory=dict)


def load_for_generation(
    weights,
    model_path: str | os.PathLike | None = None,
    rules=None,
    *,
    device: str | None = None,
    device_map: dict[str, str] | str | None = None,
    allow_unmatched: bool | None = None,
    progress: bool = False,
    log=None,
    check_config=None,
    check_tensors: bool = False,
    context: int | None = None,
    lora=None,
    chat_template: str | None = None,
) -> LoadedModel:
    """The load of ``local_chat``, the server and ``ktransformers.load``: :func:`plan_load` (weights
    header, config read once, rules parsed once, the plan made once and checked on the meta model),
    the memory plan's check, all *before* any weight or the tokenizer is read, then the tokenizer,
    then :func:`load_planned` (the weights).  ``log(msg)`` hears each step as it starts;
    ``check_config(config)`` may refuse the config (e.g. a mode for another architecture).
    Before the weights load, the chat template must compile and, with ``check_tensors``, no
    tensor may hold NaN/Inf (``weights.gguf_checks.preflight``): a server refuses to start
    rather than failing every request.  ``context``: the tokens the KV cache will hold, counted in
    the memory plan's check, or a function of the config giving them (None: reported up to the
    model's limit, not counted).

    ``allow_unmatched`` defaults to True for the shipped rule file (a family file may cover
    modules a given model lacks) and False for rules the caller names.  ``lora``: a LoRA adapter
    folder (PEFT format) applied once the weights are loaded.  ``chat_template``: a Jinja file or
    template name replacing the model's own (``--chat_template``).
    """
    import time

    say = log or (lambda msg: None)
    t0 = time.perf_counter()
    from ..util.chat_templates import precheck_chat_template

    precheck_chat_template(chat_template)  # a bad file fails before anything is read
    if model_path and Path(model_path).is_file():
        model_path = str(Path(model_path).parent)
    planned = plan_load(weights, model_path, rules, device=device, device_map=device_map,
                        allow_unmatched=allow_unmatched, check_config=check_config, log=say)
    source, config, model, plan = planned.source, planned.config, planned.model, planned.plan
    if callable(context):  # the server's context is the model's own limit unless --cache_lens names one
        context = context(config)
    check_memory_plan(model, plan, source, say, context)
    t_plan = time.perf_counter()
    say("building the tokenizer ...")
    tokenizer = load_tokenizer(model_path, source, chat_template)
    from ..weights.gguf_checks import preflight

    preflight(source, tokenizer, tokenizer.kt_template_origin, check_tensors, log)  # where errors point
    t_tok = time.perf_counter()
    n = len(source.names()) if hasattr(source, "names") else 0
    say(f"loading {n} tensors onto {', '.join(sorted(str(d) for d in plan.devices()))} ...")
    if lora is not None:
        read_adapter(lora)  # a bad adapter fails before the weights load
    load_planned(planned, progress=progress, lora=lora)
    gen_cfg = Path(model_path) / "generation_config.json" if model_path else None
    if gen_cfg is not None and gen_cfg.is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(model_path), local_files_only=True)
    t_end = time.perf_counter()
    phases = {"header and plan": t_plan - t0, "tokenizer": t_tok - t_plan, "weights": t_end - t_tok}
    return LoadedModel(model, tokenizer, source, config, planned.rules, t_end - t0, phases)


def load_draft_model(spec: str | None, draft_max: int, tokenizer, *, device=None, device_map=None, log=None):
    """The draft model of ``--speculative draft:PATH`` (its default rules), or None for another
    drafter; its tokenizer must be the model's (the same tokens under the same ids)."""
    from ..generation.speculative import parse_speculative

    name, path = parse_speculative(spec, draft_max)
    if name != "draft":
        return None
    draft = load_for_generation(path, None, None, device=device, device_map=device_map)
    if draft.tokenizer is not None and tokenizer is not None and draft.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"--speculative draft:{path}: its tokenizer's vocabulary differs from the model's; a draft "
                          "model must share the model's tokenizer")
    if log is not None:
        log(f"draft model: {path} ({type(draft.model).__name__})")
    return draft.model
