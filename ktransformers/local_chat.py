"""Chat with a model in the terminal: ``python -m ktransformers.local_chat --gguf_path MODEL.gguf``.

Interactive by default (streaming, multi-turn through the tokenizer's chat template, or the one
``--chat_template`` names); with ``--prompt TEXT`` it prints one answer and exits.  Errors print
one ``error: ...`` line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from .errors import ConfigError, run_command  # noqa: E402

BLOCK = '"""'
BANNER = ('Type a message and press Enter.  A line of """ opens/closes a multi-line block; '
          "Ctrl-C stops an answer; Ctrl-D (or Ctrl-C twice) exits; /help lists commands.")
COMMANDS = {
    "/help": "this list",
    "/clear": "forget the conversation so far (start a new one)",
    "/undo": "forget the last question and its answer (an answer stopped with Ctrl-C stays in the "
             "conversation, as far as it got, until /undo)",
    "/stats": "token counts and rates of the last answer; '/stats on' / '/stats off' after every answer",
    "/image": "PATH: attach a picture to your next message (vision-language models)",
    "/exit": "leave (also Ctrl-D)",
}
HELP = "\n".join([f"  {c:<8} {what}" for c, what in COMMANDS.items()]
                 + ["  //text   sends '/text' to the model", '  """      opens/closes a multi-line block',
                    "  a path   sends that file's text (an absolute /path too, when the file exists)"])


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints usage too)
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m ktransformers.local_chat",
                description="Chat with a (MoE) model whose modules are placed by a YAML rule file.")
    a = p.add_argument
    a("--model_path", help="folder with config.json / tokenizer / generation_config.json (optional when the GGUF "
                           "carries config and tokenizer; also used as the weights when --gguf_path is absent)")
    a("--gguf_path", help="weights: a .gguf file, a folder of GGUF shards, or safetensors file/folder")
    a("--mmproj", metavar="PATH", help="llama.cpp's vision-tower GGUF (mmproj-*.gguf) of the --gguf_path "
                                       "vision-language model (Qwen3-VL-MoE): pictures through /image")
    a("--optimize_config_path", help="YAML rule file (default: the shipped rule file for the architecture)")
    a("--lora_path", help="LoRA adapter folder (PEFT format, e.g. from python -m ktransformers.sft) applied "
                          "to the model")
    a("--chat_template", metavar="NAME|FILE",
      help="chat template instead of the model's own: a Jinja file, or a name (chatml, gemma, llama3, or a "
           "template the GGUF names as tokenizer.chat_template.NAME)")
    a("--max_new_tokens", type=int, default=1000,
      help="most tokens per answer (default 1000); an answer cut there is marked")
    a("--cpu_infer", type=int, default=None, help="CPU threads for torch and the CPU kernels (default: physical cores)")
    a("--use_cuda_graph", action=argparse.BooleanOptionalAction, default=None,
      help="capture the decode step in a CUDA graph (CUDA only; ignored with a note on CPU)")
    a("--prompt_file", help="file whose text is sent when you enter an empty line")
    a("--check_tensors", action="store_true", help="read every weight once at start and refuse NaN/Inf "
                                                   "(as llama.cpp's flag)")
    a("--mode", choices=["normal", "long_context"], default="normal",
      help="long_context (Llama only): keep the KV cache in CPU memory")
    a("--force_think", action="store_true", help="start every answer with '<think>\\n' (reasoning models)")
    a("--chunk_size", type=int, default=8192, help="prompt tokens per prefill step (default 8192)")
    a("--speculative", default=None, metavar="ngram|mtp|draft:PATH",
      help="speculative decoding, the same answer: ngram = prompt lookup (guesses copied from the text so far; "
           "pays where the answer repeats the prompt), mtp = the model's own multi-token-prediction layer "
           "(DeepSeek-V3 / R1 checkpoints), draft:PATH = a smaller model of the same vocabulary "
           "(GGUF or folder, default rules); docs/speculative.md")
    a("--draft_max", type=int, default=8, help="most guessed tokens per speculative step (1-32, default 8)")
    a("--device", default=None, help="device for modules no rule places (default cuda:0 if available, else cpu)")
    a("--device_map", default=None, metavar="FROM=TO[,...]",
      help="rewrite the devices the rule file names, e.g. cuda=cpu to try a GPU rule file on a CPU-only machine")
    a("--progress", action=argparse.BooleanOptionalAction, default=None,
      help="print each loading step as it starts, on stderr (default: on when stderr is a terminal)")
    a("--prompt", help="one-shot: answer this prompt, print the answer and exit")
    a("--temperature", type=float, default=None,
      help="sampling temperature; 0 = greedy (default: the model's generation_config, else greedy)")
    a("--top_p", type=float, default=None, help="nucleus sampling mass (default: generation_config, else 1.0)")
    a("--top_k", type=int, default=None, help="sample from the k best tokens, 0 = off (default: generation_config)")
    a("--repetition_penalty", type=float, default=None, help="penalty for repeated tokens, 1.0 = off")
    a("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    a("--stats", action=argparse.BooleanOptionalAction, default=None,
      help="print the prompt/eval token-rate line after each answer, on stderr (default: on when interactive)")
    return p


# ------------------------------------------------------------------------------------- setup


def load_tokenizer(model_path, source):
    """The tokenizer for ``model_path`` / ``source`` (see :func:`ktransformers.loading.load_tokenizer`)."""
    from .loading import load_tokenizer as load

    return load(model_path, source)


def default_sampling(args, model):
    from .generation import SamplingParams

    gc = getattr(model, "generation_config", None)
    sampling = bool(getattr(gc, "do_sample", False))
    t = args.temperature
    if t is None:
        t = float(getattr(gc, "temperature", None) or 1.0) if sampling else 0.0
    top_p = args.top_p if args.top_p is not None else (float(getattr(gc, "top_p", None) or 1.0) if sampling else 1.0)
    top_k = args.top_k if args.top_k is not None else (int(getattr(gc, "top_k", None) or 0) if sampling else 0)
    rp = args.repetition_penalty if args.repetition_penalty is not None else \
        float(getattr(gc, "repetition_penalty", None) or 1.0)
    return SamplingParams(temperature=t, top_p=top_p, top_k=top_k, max_new_tokens=args.max_new_tokens,
                          seed=args.seed, repetition_penalty=rp).validate()


def _check_args(args) -> None:
    for flag in ("model_path", "gguf_path", "mmproj", "optimize_config_path", "prompt_file", "lora_path"):
        v = getattr(args, flag)
        if v is not None and not Path(v).exists():
            raise ConfigError(f"--{flag} {v}: no such file or directory")
    if not args.gguf_path and not args.model_path:
        raise ConfigError("no weights: pass --gguf_path (a .gguf file or folder) or --model_path with safetensors")
    if args.mmproj and not args.gguf_path:
        from .weights import mmproj_without_gguf

        raise mmproj_without_gguf(args.mmproj, args.model_path)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be at least 1 (got {args.max_new_tokens})")
    if args.chunk_size < 1:
        raise ConfigError(f"--chunk_size must be at least 1 (got {args.chunk_size})")
    from .generation.speculative import parse_speculative

    parse_speculative(args.speculative, args.draft_max)
    if args.cpu_infer is not None and args.cpu_infer < 1:
        raise ConfigError(f"--cpu_infer must be at least 1 (got {args.cpu_infer})")


def ready_line(loaded, started: float, now: float) -> str:
    """Where the time to the first prompt went, phase by phase: the start-up (imports), the loader's
    phases (:attr:`LoadedModel.phases`), and what the tokenizer and the weights phases did."""
    startup = max(0.0, now - started - loaded.seconds)
    parts = [f"start-up {startup:.1f} s (torch, transformers, CPU kernels)"]
    notes = {"tokenizer": getattr(loaded.tokenizer, "kt_tokenizer_note", None)}
    report = getattr(loaded.model, "kt_load_report", None)
    if report is not None:
        per = ", ".join(f"{d}: {b / 2**30:.2f} GiB" for d, b in sorted(report.bytes_per_device.items()))
        mapped = "; mapped from the file: its pages are read as the first answers touch them" \
            if _mapped(loaded.source) else ""
        notes["weights"] = f"{per}{mapped}" if per else None
    for phase, seconds in loaded.phases.items():
        note = notes.get(phase)
        parts.append(f"{phase} {seconds:.1f} s" + (f" ({note})" if note else ""))
    return f"ready in {now - started:.1f} s: " + ", ".join(parts) + f"; rules: {loaded.rules}"


def _drafter_name(spec, draft_max):
    from .generation.speculative import parse_speculative

    return parse_speculative(spec, draft_max)[0]


def _mapped(source) -> bool:
    """Weights served from a memory-mapped GGUF (their pages load on first use, not at load)."""
    return hasattr(source, "tensor_info")


def load(args, log=print, progress=None, started: float | None = None):
    """(model, tokenizer, generator) for parsed ``args``, through the loader the server uses too."""
    import torch

    from .generation import Generator
    from .optimize_rules import architecture
    from .loading import load_draft_model, load_for_generation

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda") and args.use_cuda_graph:
        log("note: --use_cuda_graph applies only on CUDA; decoding without CUDA graphs")
    elif device.startswith("cuda") and args.use_cuda_graph:
        log("note: CUDA graph capture is not implemented yet; decoding eagerly")

    def check_config(config):
        arch = architecture(config)
        if args.mode == "long_context" and arch != "LlamaForCausalLM":
            raise ConfigError(f"--mode long_context is only supported for LlamaForCausalLM, not {arch}")

    from .weights import open_weights_arg

    loaded = load_for_generation(open_weights_arg(args.gguf_path or args.model_path, args.mmproj),
                                 args.model_path, args.optimize_config_path,
                                 device=device, device_map=args.device_map, progress=True,
                                 log=progress, check_config=check_config, check_tensors=args.check_tensors,
                                 lora=args.lora_path, chat_template=args.chat_template)
    model, tokenizer = loaded.model, loaded.tokenizer
    now = time.perf_counter()
    log(ready_line(loaded, now - loaded.seconds if started is None else started, now))
    if not getattr(tokenizer, "chat_template", None):
        from .util.chat_templates import ADD_TEMPLATE_HINT

        log(f"note: the model has no chat template: prompts are continued as plain text; {ADD_TEMPLATE_HINT}")
    gen = Generator(model, tokenizer, chunk_size=args.chunk_size, offload_cache=args.mode == "long_context",
                    speculative=_drafter_name(args.speculative, args.draft_max), draft_max=args.draft_max,
                    draft_model=load_draft_model(args.speculative, args.draft_max, tokenizer, device=device,
                                                 device_map=args.device_map, log=log))
    from .multimodal.chat import image_support
    from .multimodal.images import ImageLimits
    from .weights.model_config import weights_folder

    # what /image needs: the model's processor (None: a text model); the user's own files are readable
    gen.images = image_support(model.config, tokenizer, args.model_path or weights_folder(loaded.source),
                               ImageLimits(allow_local_files=True), source=loaded.source)
    return model, tokenizer, gen


# ---------------------------------------------------------------------------------- chatting


def _think_prefix(gen) -> list[int]:
    return gen.encode("<think>\n", add_special_tokens=False)


def answer(gen, messages, params, force_think, out=sys.stdout, cancel=None, parts=None,
           images=()) -> tuple[str, str]:
    """Stream one answer to ``out``; (text, finish_reason).  ``parts`` collects the text as it
    comes, so a caller interrupted mid-answer still has what was shown.  ``images``: the
    conversation's pictures, in the order of their markup in ``messages`` (``/image``)."""
    ids = gen.apply_chat_template(messages)
    if force_think:
        ids = ids + _think_prefix(gen)
        out.write("<think>\n")
        out.flush()
    if images:
        ids = gen.images.prompt(gen.tokenizer.decode(ids), list(images))
    parts = [] if parts is None else parts
    finish = "stop"
    for ev in gen.stream(ids, params, cancel):
        if ev.text:
            out.write(ev.text)
            out.flush()
            parts.append(ev.text)
        if ev.finish_reason is not None:
            finish = ev.finish_reason
    return "".join(parts), finish


def length_marker(params) -> str:
    """The line after an answer that ran to the token limit (it was cut, not finished)."""
    n = params.max_new_tokens
    return f"[cut: the answer reached --max_new_tokens ({n} token{'' if n == 1 else 's'})]"


def _read_block(first: str) -> str:
    """Lines up to a line ending in triple quotes (the opening line's rest included)."""
    rest = first.strip()[len(BLOCK):]
    if rest.rstrip().endswith(BLOCK):  # """one line"""
        return rest.rstrip()[: -len(BLOCK)]
    lines = [rest] if rest else []
    while True:
        try:
            line = input("... ")
        except EOFError:
            break
        if line.rstrip().endswith(BLOCK):
            tail = line.rstrip()[: -len(BLOCK)]
            if tail:
                lines.append(tail)
            break
        lines.append(line)
    return "\n".join(lines)


class _SigintCancels:
    """While active, Ctrl-C sets ``cancel`` (a second one raises KeyboardInterrupt)."""

    def __init__(self, cancel: threading.Event):
        self.cancel = cancel

    def _handler(self, signum, frame):
        if self.cancel.is_set():
            raise KeyboardInterrupt
        self.cancel.set()

    def __enter__(self):
        self.prev = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.prev)
        return False


def interactive(gen, params, args) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    stats = args.stats if args.stats is not None else True
    if gen.has_chat_template():
        mode = f"chat template: {getattr(gen.tokenizer, 'kt_template_origin', None) or 'the tokenizer'}"
    else:  # the load's note says how to add one
        mode = "plain completion (no chat template)"
    print(f"{BANNER}\n[{mode}]", flush=True)
    history: list[dict] = []
    images: list = []       # the conversation's pictures, in order; turn_images: how many each turn added
    turn_images: list[int] = []
    from .multimodal.images import ImageError

    attached = getattr(gen, "images", None) and gen.images.collector()  # /image files for the next message
    interrupted = False
    while True:
        try:
            line = input("Chat: ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            if interrupted:
                print()
                return 0
            print("\n(press Ctrl-C again or Ctrl-D to exit)", flush=True)
            interrupted = True
            continue
        interrupted = False
        if _is_command(line):
            word, _, rest = line.strip().partition(" ")
            if word == "/exit":
                return 0
            if word == "/help":
                print(HELP, flush=True)
            elif word == "/clear":
                history, images, turn_images = [], [], []
                attached = attached and gen.images.collector()
                print("[conversation cleared]", flush=True)
            elif word == "/image":
                print(_attach_image(attached, rest.strip()), flush=True)
            elif word == "/undo":
                if history:
                    history = history[:-2]
                    del images[len(images) - (turn_images.pop() if turn_images else 0):]
                    print(f"[last question and answer forgotten; {len(history) // 2} turn(s) left]", flush=True)
                else:
                    print("[nothing to undo]", flush=True)
            elif word == "/stats":
                if rest.strip() in ("on", "off"):
                    stats = rest.strip() == "on"
                    print(f"[stats after each answer: {rest.strip()}]", flush=True)
                elif gen.last_stats is None:
                    print("[no answer yet]", flush=True)
                else:
                    print(gen.last_stats.line(), flush=True)
            else:
                shown = word if len(word) <= 80 else word[:77] + "..."
                print(f"[unknown command {shown} (and no such file); /help lists the commands, //text sends "
                      f"text starting with '/']", flush=True)
            continue
        try:
            if line.strip().startswith("//"):
                content = line.strip()[1:]
            elif line.strip().startswith(BLOCK):
                content = _read_block(line)
            elif not line.strip():
                if not args.prompt_file:
                    continue
                content = _read_prompt_file(args.prompt_file)
            elif _names_file(line.strip()):
                content = _read_prompt_file(line.strip())
            else:
                content = line
        except KeyboardInterrupt:
            print("\n(input discarded)", flush=True)
            continue
        except (OSError, UnicodeDecodeError) as e:
            print(f"[cannot read {line.strip() or args.prompt_file}: "
                  f"{getattr(e, 'strerror', None) or 'not UTF-8 text'}]", flush=True)
            continue
        if not content.strip():
            continue
        new_images = attached.images if attached else []
        if new_images:  # the pictures first, as the chat routes put an image part before its text
            content = attached.support.markup * len(new_images) + "\n" + content
            attached = gen.images.collector()
        msgs = history + [{"role": "user", "content": content}]
        cancel = threading.Event()
        parts: list[str] = []
        try:
            with _SigintCancels(cancel):
                text, finish = answer(gen, msgs, params, args.force_think, cancel=cancel, parts=parts,
                                      images=images + new_images)
        except KeyboardInterrupt:
            text, finish = "".join(parts), "cancelled"
        except ImageError as e:  # the text itself holds an image placeholder
            print(f"[{e}]", flush=True)
            continue
        images += new_images
        turn_images.append(len(new_images))
        print(flush=True)
        # the turn stays as the user saw it, a stopped answer as far as it got (/undo drops it)
        history = msgs + [{"role": "assistant", "content": text}]
        if finish == "cancelled":
            print("[stopped: the question and the answer so far stay in the conversation; /undo forgets them]",
                  flush=True)
            interrupted = True
        elif finish == "length":
            print(length_marker(params), flush=True)
        if stats and gen.last_stats is not None:
            print(gen.last_stats.line(), file=sys.stderr, flush=True)


def _attach_image(attached, path: str) -> str:
    """``/image PATH``: the picture decoded now (a bad one is refused here, in one line)."""
    from .multimodal.images import ImageError

    if not attached:
        return "[/image needs a vision-language model; this one takes text only]"
    if not path:
        return "[/image PATH: name a picture file (PNG, JPEG, WebP, GIF, BMP)]"
    try:
        attached.add_path(path)
    except ImageError as e:
        return f"[{e}]"
    w, h = attached.images[-1].size
    return f"[{path}: {w}x{h} attached to your next message ({len(attached.images)} waiting)]"


def _read_prompt_file(path: str) -> str:
    content = Path(path).read_text(encoding="utf-8")
    print(f"[prompt from {path}: {len(content)} characters]", flush=True)
    return content


def _names_file(text: str) -> bool:
    """Whether a typed line is the path of an existing file; a long message or one with a NUL byte
    is text, not a path the system refuses (a name too long raises OSError)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def _is_command(line: str) -> bool:
    """A line starting with '/' is a command, unless it starts with '//' (text) or names an existing
    file (an absolute path sends that file, as /help says)."""
    text = line.strip()
    if not text.startswith("/") or text.startswith("//"):
        return False
    return text.partition(" ")[0] in COMMANDS or not _names_file(text)


def one_shot(gen, params, args) -> int:
    _, finish = answer(gen, [{"role": "user", "content": args.prompt}], params, args.force_think)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if finish == "length":  # on stderr: stdout holds the answer alone
        print(length_marker(params), file=sys.stderr, flush=True)
    if args.stats and gen.last_stats is not None:
        print(gen.last_stats.line(), file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = log if show else None

    def body() -> int:
        _check_args(args)
        if progress:
            progress("starting (torch, CPU kernels) ...")
        from .operators.cpu_threads import use_threads

        use_threads(args.cpu_infer)
        model, tokenizer, gen = load(args, log, progress, started)
        params = default_sampling(args, model)
        if args.prompt is not None:
            return one_shot(gen, params, args)
        return interactive(gen, params, args)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
