"""Hugging Face safetensors model -> GGUF file with llama.cpp names and metadata.

    python -m ktransformers.convert --model_path HF_DIR --output OUT.gguf \\
        --experts Q4_K --attention Q8_0 --default Q6_K [--embeddings Q8_0] [--output-type Q6_K] [--norms F32]
    python -m ktransformers.convert --model_path HF_DIR --output OUT.gguf --preset Q4_K_M

Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS are quantized in C++ on all cores (``KT_QUANT_THREADS``), with a
progress bar.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import KTError
from .pipeline import convert
from .policy import PRESETS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ktransformers.convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_path", "--model-path", required=True, help="Hugging Face model folder (safetensors)")
    ap.add_argument("--output", required=True, help="GGUF file to write")
    ap.add_argument("--experts", default="Q4_K", help="type of routed-expert tensors (default Q4_K)")
    ap.add_argument("--attention", default="Q8_0", help="type of attention projections (default Q8_0)")
    ap.add_argument("--default", default="Q6_K", help="type of other 2-D tensors (default Q6_K)")
    ap.add_argument("--embeddings", default=None, help="type of token_embd (default: --default)")
    ap.add_argument("--output-type", "--output_type", dest="output_type", default=None,
                    help="type of the output (lm_head) tensor (default: --default)")
    ap.add_argument("--norms", default="F32", help="type of 1-D tensors and routers (default F32)")
    ap.add_argument("--preset", default=None,
                    help=f"llama-quantize's type mix for a preset, replacing the per-role types ({', '.join(PRESETS)})")
    ap.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                    help="do not write the model folder's tokenizer into the file")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        out = convert(a.model_path, a.output, a.experts, a.attention, a.default, a.embeddings, a.output_type,
                      a.norms, log=None if a.quiet else (lambda s: print(s, file=sys.stderr)), preset=a.preset,
                      progress=not a.quiet, tokenizer=a.tokenizer)
    except KTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
