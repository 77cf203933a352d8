"""Serving benchmark: our HTTP server under concurrent streaming clients, next to llama.cpp's
``llama-server --parallel N`` on the same GGUF file.

    python bench/serving.py                                     # gemma + qwen3moe, c = 1,2,4,8, prefix rows
    python bench/serving.py --only gemma --concurrency 1,4 --threads 2
    python bench/serving.py --only gemma --concurrency 1,2 --new_tokens 8 --prompt_tokens 16 \\
        --requests 1 --prefix 200,160 --no-llama                # smoke run (~1-2 min)

Each server is a subprocess on loopback.  Prompts are token ids (``/v1/completions`` with a list
of ints, greedy, ``ignore_eos`` for llama.cpp), random but fixed by seed and unique per request,
so no request hits another's cache in the concurrency rows.

Rows:
* **concurrency** c in ``--concurrency``: c clients at once, each sending ``--requests``
  streaming requests one after another (``--prompt_tokens`` prompt, ``--new_tokens`` answer).
  ``agg tok/s`` = all generated tokens / wall time of the wave; ``stream tok/s`` = median
  per-request decode rate after its first token; TTFT p50/p99 = send -> first streamed text.
  Scaling = agg(c) / agg(1); vs llama.cpp = ours / theirs at the same c.
* **prefix**: TTFT of a ``--prefix`` L-token prompt cold, then of a prompt sharing its first K
  tokens (``--prefix 1000,900``).  When the server reports a prefix cache on /metrics, filler
  prompts first push the cached pages out of the device pool (``--cache_lens`` is set to
  ``--prefix_cache_lens`` for this server), and the tier that served the hit is read from
  ``ktransformers_prefix_cache_hits_total``.  When the server has ``--prefix_cache_dir``, it is
  restarted on the same folder and a third prompt with the same K-token prefix measures the
  disk tier.  llama.cpp's row uses its slot prompt cache (same server, no restart).

It works against any version of our server: without batching the concurrency rows show what one
request at a time gives, and without a prefix cache the cached rows show no gain.

Models: Gemma-3-270M Q4_K_M and the Qwen3-MoE-shaped 4-layer GGUF, found (or built) exactly as
``bench/e2e.py`` does; the MoE file carries no tokenizer, so our server gets Gemma's (exported
once into .cache/models/gemma-3-270m-tokenizer; ids stay below the MoE vocab).  llama.cpp:
``--llama_cpp_bin DIR`` (or ``$KT_LLAMA_CPP_BIN``) holding ``llama-server`` (see bench/README.md
for building it); ``--no-llama`` skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
MODELS = ROOT / ".cache" / "models"

import httpx  # noqa: E402
import numpy as np  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------- servers


class Server:
    """A server subprocess on loopback; ``kind`` is ``ours`` or ``llama.cpp``."""

    def __init__(self, kind: str, cmd: list[str], port: int, log: Path, env=None):
        self.kind, self.cmd, self.port, self.log = kind, cmd, port, log
        self.url = f"http://127.0.0.1:{port}"
        with open(log, "ab") as f:
            f.write(("\n$ " + " ".join(cmd) + "\n").encode())
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.time() + 900
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited with {self.proc.returncode}; log {log}:\n"
                                   + log.read_text(errors="replace")[-2000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"{kind} server did not come up in 900 s; log {log}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)  # ours writes its prefix cache to disk at shutdown
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def metrics(self) -> dict:
        """Prefix-cache hits per tier from /metrics ({} when the server reports none)."""
        if self.kind != "ours":
            return {}
        try:
            text = httpx.get(self.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        hits = {}
        for m in re.finditer(r'^ktransformers_prefix_cache_hits_total\{tier="(\w+)"\} ([0-9.e+]+)$', text, re.M):
            hits[m.group(1)] = float(m.group(2))
        return hits


def our_flags() -> str:
    """Our server's --help: which optional flags (prefix cache, batching) this version has."""
    r = subprocess.run([sys.executable, "-m", "ktransformers.server", "--help"], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return r.stdout


def start_ours(args, model: "BenchModel", tag: str, *, cache_lens: int, prefix_dir: Path | None = None) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "ktransformers.server", "--gguf_path", str(model.path), "--port", str(port),
           "--data_dir", str(args.work / f"data-{tag}"), "--cpu_infer", str(args.threads),
           "--max_new_tokens", str(args.new_tokens), "--max_queue", "64", "--cache_lens", str(cache_lens),
           "--model_name", model.name, "--log_level", "warning"]
    if model.tokenizer_dir is not None:
        cmd += ["--model_path", str(model.tokenizer_dir)]
    if "--prefix_cache_ram_gb" in args.flags:
        cmd += ["--prefix_cache_ram_gb", str(args.prefix_cache_ram_gb)]
    if prefix_dir is not None and "--prefix_cache_dir" in args.flags:
        cmd += ["--prefix_cache_dir", str(prefix_dir), "--prefix_cache_disk_gb", str(args.prefix_cache_disk_gb)]
    if "--max_batch_size" in args.flags:
        cmd += ["--max_batch_size", str(max(args.concurrency))]
    cmd += args.server_args.split()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return Server("ours", cmd, port, args.work / f"ours-{tag}.log", env=env)


def start_llama(args, model: "BenchModel", parallel: int, ctx_per_slot: int, tag: str) -> Server:
    port = free_port()
    cmd = [str(args.llama_bin / "llama-server"), "-m", str(model.path), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "--parallel", str(parallel),
           "-c", str(parallel * ctx_per_slot), "-ngl", "0", "--no-webui"]
    return Server("llama.cpp", cmd, port, args.work / f"llama-{tag}.log")


# ----------------------------------------------------------------------------------- client


@dataclass
class Result:
    sent: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def stream_tps(self) -> float | None:
        if self.first is None or self.end is None or self.tokens < 2 or self.end <= self.first:
            return None
        return (self.tokens - 1) / (self.end - self.first)


async def stream_request(client: httpx.AsyncClient, url: str, ids: list[int], new_tokens: int) -> Result:
    """One streaming /v1/completions request; TTFT = arrival of the first token's chunk."""
    body = {"prompt": ids, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "cache_prompt": True}
    res = Result(time.perf_counter())
    chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                d = json.loads(data)
                if d.get("error"):
                    res.error = str(d["error"])[:200]
                    break
                for ch in d.get("choices") or []:
                    # a token: text, or (llama.cpp on a vocab-less file) a chunk that is not the final one
                    if ch.get("text") or ch.get("finish_reason") is None:
                        chunks += 1
                        if res.first is None:
                            res.first = time.perf_counter()
                usage = d.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.tokens = int(usage["completion_tokens"])
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    if res.first is None and res.error is None:
        res.first = res.end
    res.tokens = res.tokens or chunks
    return res


def prompt_ids(model: "BenchModel", n: int, *seed) -> list[int]:
    rng = np.random.default_rng([zlib.crc32(str(s).encode()) for s in seed])  # the same in every run
    return [int(x) for x in rng.integers(100, min(model.vocab, 30000), n)]


async def wave(url: str, model, c: int, args) -> list[Result]:
    """``c`` clients at once, each sending ``args.requests`` requests in a row."""
    limits = httpx.Limits(max_connections=c + 2, max_keepalive_connections=c + 2)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        async def one_client(i: int) -> list[Result]:
            return [await stream_request(client, url, prompt_ids(model, args.prompt_tokens, 7, c, i, j),
                                         args.new_tokens) for j in range(args.requests)]

        per = await asyncio.gather(*(one_client(i) for i in range(c)))
    return [r for rs in per for r in rs]


def summarize(results: list[Result]) -> dict:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    if not ok:
        return {"errors": errors}
    wall = max(r.end for r in ok) - min(r.sent for r in ok)
    ttfts = [r.ttft for r in ok]
    rates = [r.stream_tps for r in ok if r.stream_tps is not None]
    return {"requests": len(ok), "tokens": sum(r.tokens for r in ok), "wall_s": wall,
            "agg_tps": sum(r.tokens for r in ok) / wall if wall > 0 else None,
            "stream_tps": float(np.median(rates)) if rates else None,
            "ttft_p50": float(np.percentile(ttfts, 50)), "ttft_p99": float(np.percentile(ttfts, 99)),
            "errors": errors}


async def one(url: str, ids: list[int], args, new_tokens: int = 1) -> Result:
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        return await stream_request(client, url, ids, new_tokens)


# ----------------------------------------------------------------------------------- models


@dataclass
class BenchModel:
    key: str
    name: str
    path: Path
    vocab: int
    tokenizer_dir: Path | None = None
    rows: dict = field(default_factory=dict)


def gemma_tokenizer_dir(gemma: Path) -> Path:
    """Gemma's tokenizer as a folder (for the MoE-shaped model, whose GGUF has none)."""
    out = MODELS / "gemma-3-270m-tokenizer"
    if (out / "tokenizer_config.json").is_file():
        return out
    from ktransformers.weights import open_weights

    tok = open_weights(gemma).tokenizer()
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    return out


def find_models(args) -> list[BenchModel]:
    import e2e

    out = []
    only = set(args.only.split(","))
    gemma = None
    if "gemma" in only or "qwen3moe" in only:
        try:
            gemma = e2e.gemma_path()
        except ImportError as e:
            print(f"note: Gemma-3-270M is not available ({e}); gemma rows skipped")
    if "gemma" in only and gemma is not None:
        out.append(BenchModel("gemma", "gemma-3-270m-q4_k_m", gemma, 262144))
    if "qwen3moe" in only:
        p = e2e.qwen3moe_path(args)
        if p is not None and gemma is not None:
            out.append(BenchModel("qwen3moe", "qwen3moe-shaped-4l", p, args.vocab, gemma_tokenizer_dir(gemma)))
        elif p is not None:
            print("note: the MoE-shaped model needs Gemma's tokenizer for our server; qwen3moe rows skipped")
    return out


# ----------------------------------------------------------------------------------- phases


def run_concurrency(args, model: BenchModel) -> None:
    ctx = args.prompt_tokens + args.new_tokens + 16
    rows = model.rows.setdefault("concurrency", {})
    srv = start_ours(args, model, f"{model.key}-conc", cache_lens=max(ctx * max(args.concurrency), 2048))
    try:
        asyncio.run(wave(srv.url, model, 1, argparse.Namespace(**{**vars(args), "requests": 1})))  # warm-up
        for c in args.concurrency:
            rows.setdefault(c, {})["ours"] = s = summarize(asyncio.run(wave(srv.url, model, c, args)))
            print(f"  ours      c={c}: {_fmt_row(s)}", flush=True)
    finally:
        srv.stop()
    if args.llama_bin is None:
        return
    for c in args.concurrency:
        try:
            srv = start_llama(args, model, c, ctx, f"{model.key}-c{c}")
        except RuntimeError as e:
            print(f"note: llama-server failed on {model.path.name}: {str(e).splitlines()[0]}")
            return
        try:
            asyncio.run(wave(srv.url, model, 1, argparse.Namespace(**{**vars(args), "requests": 1})))
            rows[c]["llama.cpp"] = s = summarize(asyncio.run(wave(srv.url, model, c, args)))
            print(f"  llama.cpp c={c}: {_fmt_row(s)}", flush=True)
        finally:
            srv.stop()


def _fmt_row(s: dict) -> str:
    if s.get("agg_tps") is None:
        return f"failed: {s.get('errors', [])[:2]}"
    err = f", {len(s['errors'])} errors" if s["errors"] else ""
    return (f"{s['agg_tps']:.1f} tok/s aggregate, {s['stream_tps'] or 0:.1f} per stream, TTFT p50 "
            f"{s['ttft_p50']:.2f} s p99 {s['ttft_p99']:.2f} s{err}")


def run_prefix(args, model: BenchModel) -> None:
    L, K = args.prefix
    rows = model.rows.setdefault("prefix", {})
    base = prompt_ids(model, L, 11, "base")
    variant = lambda tag: base[:K] + prompt_ids(model, L - K, 11, tag)  # noqa: E731
    cache_dir = args.work / f"prefix-cache-{model.key}"
    srv = start_ours(args, model, f"{model.key}-prefix", cache_lens=args.prefix_cache_lens, prefix_dir=cache_dir)
    r: dict = {}
    try:
        asyncio.run(one(srv.url, prompt_ids(model, 32, 11, "warm"), args))  # warm-up
        cold = asyncio.run(one(srv.url, base, args))
        r["cold"] = cold.ttft
        has_cache = bool(srv.metrics())
        if has_cache:  # push the prompt's pages out of the device pool, so RAM (or disk) serves them
            for i in range(args.prefix_cache_lens // L + 2):
                asyncio.run(one(srv.url, prompt_ids(model, L, 11, "filler", i), args))
        before = srv.metrics()
        hit = asyncio.run(one(srv.url, variant("ram"), args))
        after = srv.metrics()
        r["cached"], r["cached_tiers"] = hit.ttft, _delta(before, after)
    finally:
        srv.stop()
    if "--prefix_cache_dir" in args.flags:
        srv = start_ours(args, model, f"{model.key}-prefix-restart", cache_lens=args.prefix_cache_lens,
                         prefix_dir=cache_dir)
        try:
            asyncio.run(one(srv.url, prompt_ids(model, 32, 11, "warm2"), args))
            before = srv.metrics()
            hit = asyncio.run(one(srv.url, variant("disk"), args))
            r["disk"], r["disk_tiers"] = hit.ttft, _delta(before, srv.metrics())
        finally:
            srv.stop()
    rows["ours"] = r
    print(f"  ours      prefix {L}/{K}: {_fmt_prefix(r)}", flush=True)
    if args.llama_bin is None:
        return
    try:
        srv = start_llama(args, model, 1, L + 64, f"{model.key}-prefix")
    except RuntimeError as e:
        print(f"note: llama-server failed on {model.path.name}: {str(e).splitlines()[0]}")
        return
    try:
        asyncio.run(one(srv.url, prompt_ids(model, 32, 11, "warm"), args))
        rows["llama.cpp"] = q = {"cold": asyncio.run(one(srv.url, base, args)).ttft}
        q["cached"] = asyncio.run(one(srv.url, variant("ram"), args)).ttft
        q["cached_tiers"] = {"slot cache": None}
    finally:
        srv.stop()
    print(f"  llama.cpp prefix {L}/{K}: {_fmt_prefix(q)}", flush=True)


def _delta(before: dict, after: dict) -> dict:
    return {t: int(after.get(t, 0) - before.get(t, 0)) for t in after if after.get(t, 0) - before.get(t, 0) > 0}


def _fmt_prefix(r: dict) -> str:
    if r.get("cold") is None or r.get("cached") is None:
        return "failed (no first token; see the server's log)"
    s = f"cold {r['cold']:.2f} s, cached {r['cached']:.2f} s ({r['cached'] / r['cold']:.2f}x"
    s += f", pages by tier {r['cached_tiers']})" if r.get("cached_tiers") else ", no prefix-cache hits reported)"
    if r.get("disk") is not None:
        s += f", after restart {r['disk']:.2f} s ({r['disk'] / r['cold']:.2f}x, pages by tier {r['disk_tiers']})"
    return s


# ----------------------------------------------------------------------------------- report


def report(models: list[BenchModel], args) -> None:
    for m in models:
        conc = m.rows.get("concurrency", {})
        if conc:
            print(f"\n### {m.name}: {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
                  f"{args.requests} request(s) per client, {args.threads} threads\n")
            print("| c | server | agg tok/s | scaling vs c=1 | per-stream tok/s | TTFT p50 s | TTFT p99 s | "
                  "agg ours/llama.cpp |\n|---|---|---|---|---|---|---|---|")
            for c in sorted(conc):
                for srv in ("ours", "llama.cpp"):
                    s = conc[c].get(srv)
                    if not s or s.get("agg_tps") is None:
                        continue
                    one_ = conc.get(1, conc[min(conc)]).get(srv, {}).get("agg_tps")
                    ratio = ""
                    if srv == "ours" and conc[c].get("llama.cpp", {}).get("agg_tps"):
                        ratio = f"{s['agg_tps'] / conc[c]['llama.cpp']['agg_tps']:.2f}"
                    print(f"| {c} | {srv} | {s['agg_tps']:.1f} | {s['agg_tps'] / one_:.2f}x | "
                          f"{s['stream_tps'] or 0:.1f} | {s['ttft_p50']:.2f} | {s['ttft_p99']:.2f} | {ratio} |")
        pre = m.rows.get("prefix", {})
        if pre:
            L, K = args.prefix
            print(f"\n### {m.name}: TTFT of a {L}-token prompt, cold vs its first {K} tokens cached\n")
            print("| server | cold s | cached s | cached/cold | tiers | after restart s | restart/cold | tiers |\n"
                  "|---|---|---|---|---|---|---|---|")
            for srv, r in pre.items():
                if r.get("cold") is None or r.get("cached") is None:
                    print(f"| {srv} | failed | | | | | | |")
                    continue
                disk = (f"{r['disk']:.3f} | {r['disk'] / r['cold']:.2f} | {r.get('disk_tiers')}"
                        if r.get("disk") is not None else "n/a | | ")
                print(f"| {srv} | {r['cold']:.3f} | {r['cached']:.3f} | {r['cached'] / r['cold']:.2f} | "
                      f"{r.get('cached_tiers') or 'none reported'} | {disk} |")
    if args.json:
        Path(args.json).write_text(json.dumps({m.name: m.rows for m in models}, indent=1, default=str))
        print(f"\nraw results: {args.json}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="gemma,qwen3moe", help="comma list of: gemma, qwen3moe")
    ap.add_argument("--phases", default="concurrency,prefix", help="comma list of: concurrency, prefix")
    ap.add_argument("--concurrency", default="1,2,4,8", help="client counts")
    ap.add_argument("--requests", type=int, default=2, help="requests per client in a concurrency wave")
    ap.add_argument("--prompt_tokens", type=int, default=64, help="prompt length of the concurrency rows")
    ap.add_argument("--new_tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--prefix", default="1000,900", help="L,K: prompt length and cached prefix length")
    ap.add_argument("--prefix_cache_lens", type=int, default=2048,
                    help="--cache_lens of the prefix-row server (small, so filler prompts evict the device tier)")
    ap.add_argument("--prefix_cache_ram_gb", type=float, default=1.0)
    ap.add_argument("--prefix_cache_disk_gb", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=None, help="threads of both servers (default: physical cores)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocab of the Qwen3-MoE-shaped model (as bench/e2e.py)")
    ap.add_argument("--llama_cpp_bin", default=os.environ.get("KT_LLAMA_CPP_BIN"),
                    help="folder with llama.cpp's llama-server (default: $KT_LLAMA_CPP_BIN)")
    ap.add_argument("--no-llama", dest="llama", action="store_false", help="skip llama.cpp")
    ap.add_argument("--server_args", default="", help="extra flags for our server, e.g. '--chunk_size 256'")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per request")
    ap.add_argument("--work", help="folder for logs, data and the disk cache (default: a temporary one)")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args(argv)
    from ktransformers.operators.cpu_threads import physical_cores

    args.threads = args.threads or physical_cores()
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    args.prefix = tuple(int(x) for x in args.prefix.split(","))
    if len(args.prefix) != 2 or not (0 < args.prefix[1] < args.prefix[0]):
        print("error: --prefix L,K needs 0 < K < L", file=sys.stderr)
        return 2
    args.llama_bin = Path(args.llama_cpp_bin) if (args.llama and args.llama_cpp_bin) else None
    if args.llama_bin is not None and not (args.llama_bin / "llama-server").is_file():
        print(f"note: {args.llama_bin}/llama-server not found: llama.cpp rows skipped "
              "(build it: see bench/README.md, 'Serving')")
        args.llama_bin = None
    elif args.llama and args.llama_bin is None:
        print("note: no --llama_cpp_bin / KT_LLAMA_CPP_BIN: llama.cpp rows skipped")
    args.flags = our_flags()
    have = [f for f in ("--prefix_cache_dir", "--prefix_cache_ram_gb", "--max_batch_size") if f in args.flags]
    print(f"threads {args.threads}; our server has {', '.join(have) or 'none of the batching/prefix flags'}")
    tmp = None
    if args.work:
        args.work = Path(args.work)
        args.work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="kt-serving-")
        args.work = Path(tmp.name)
    phases = set(args.phases.split(","))
    models = find_models(args)
    try:
        for m in models:
            print(f"\n{m.name} ({m.path.name})", flush=True)
            if "concurrency" in phases:
                run_concurrency(args, m)
            if "prefix" in phases:
                run_prefix(args, m)
    finally:
        report(models, args)
        if tmp is not None and not args.json:
            print(f"(logs were in {args.work}; pass --work DIR to keep them)")
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
