"""Converter throughput against llama-quantize on the same F16 weights (needs a llama.cpp build).

    python bench/convert.py /path/to/llama.cpp [--preset Q4_K_M] [--threads 2]

Writes a random Qwen3-MoE-shaped HF model in float16 (hidden 1024, 2 layers, 16 experts of 512,
about 55 M parameters) into ``.cache/bench/convert``, converts it once with llama.cpp's
``convert_hf_to_gguf.py --outtype f16``, then times

* ``llama-quantize F16.gguf out.gguf PRESET THREADS`` (llama.cpp's own quantizer), and
* ``python -m ktransformers.convert --model_path HF --preset PRESET`` (ours, same threads),

and prints both in parameters per second, with the ratio (also for our converter called in-process
after its imports are warm; the fresh process takes the light path, which imports neither torch nor
transformers), and the load average before and after (the machine is shared: compare figures of one
run).  Both write the same tensor types.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".cache" / "bench" / "convert"
SHAPE = dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
             num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512, intermediate_size=2048,
             vocab_size=8192, max_position_embeddings=4096)


def make_model(folder: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ktransformers.util.tiny_models import make_tiny_tokenizer

    cfg = AutoConfig.for_model("qwen3_moe", **SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("llama_cpp", help="llama.cpp source folder with build/bin/llama-quantize")
    ap.add_argument("--preset", default="Q4_K_M")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = ap.parse_args(argv)
    lc = Path(a.llama_cpp)
    quantize_bin = next((p for p in (lc / "build" / "bin" / "llama-quantize", lc / "build-llama-py" / "bin" /
                                     "llama-quantize") if p.is_file()), None)
    if quantize_bin is None:
        print(f"error: no llama-quantize under {lc}/build/bin", file=sys.stderr)
        return 2
    hf, f16 = OUT / "hf", OUT / "F16.gguf"
    if not (hf / "config.json").is_file():
        make_model(hf)
    if not f16.is_file():
        sys.path.insert(0, str(ROOT / "scripts"))
        from make_llamacpp_fixtures import _RUN_CONVERTER

        subprocess.run([sys.executable, "-c", _RUN_CONVERTER, str(lc), str(hf), "--outtype", "f16",
                        "--outfile", str(f16)], check=True, capture_output=True)
    import gguf

    n_params = sum(int(t.n_elements) for t in gguf.GGUFReader(str(f16)).tensors)

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    subprocess.run([str(quantize_bin), str(f16), str(OUT / f"llama-{a.preset}.gguf"), a.preset, str(a.threads)],
                   check=True, capture_output=True)
    t_llama = time.perf_counter() - t0

    env = dict(os.environ, KT_QUANT_THREADS=str(a.threads), PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ktransformers.convert", "--model_path", str(hf), "--output",
                    str(OUT / f"kt-{a.preset}.gguf"), "--preset", a.preset, "-q"], check=True, env=env,
                   capture_output=True)
    t_kt = time.perf_counter() - t0

    # the same conversion in this process, imports already warm: the converter's own throughput
    os.environ["KT_QUANT_THREADS"] = str(a.threads)
    from ktransformers.convert import convert

    convert(hf, OUT / "warm.gguf", preset="F16", tokenizer=False)  # imports and page cache
    t0 = time.perf_counter()
    convert(hf, OUT / f"kt-warm-{a.preset}.gguf", preset=a.preset)
    t_warm = time.perf_counter() - t0

    a_types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(OUT / f"llama-{a.preset}.gguf")).tensors}
    b_types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(OUT / f"kt-{a.preset}.gguf")).tensors}
    same = sum(a_types[k] == b_types.get(k) for k in a_types)
    print(f"{n_params / 1e6:.1f} M parameters, preset {a.preset}, {a.threads} thread(s)")
    print(f"llama-quantize (F16 GGUF -> {a.preset}):    {t_llama:6.1f} s  {n_params / t_llama / 1e6:6.2f} M params/s")
    print(f"ktransformers.convert (F16 HF -> {a.preset}): {t_kt:6.1f} s  {n_params / t_kt / 1e6:6.2f} M params/s"
          f"  (whole process, start-up included)")
    print(f"ktransformers.convert, in process, warm:      {t_warm:6.1f} s  {n_params / t_warm / 1e6:6.2f} M params/s")
    print(f"ratio (ours / llama-quantize): {t_llama / t_kt:.2f}x whole process, {t_llama / t_warm:.2f}x warm; "
          f"tensor types equal: {same}/{len(a_types)}")
    print("load average (1/5/15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
        *load_before, *os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
