"""llama-quantize's per-tensor types and round-trip errors for the IQ4 presets (the converter's reference).

    python tests/llama_quant_reference.py LLAMA_CPP_DIR        # rewrites tests/fixtures/llamacpp/iq4_reference.json

For each tiny model of ``../shared/fixtures`` the HF weights are written as an all-F32 GGUF (our
converter; F32 is exact), quantized by llama.cpp's own ``llama-quantize`` (no importance matrix)
with each preset, and every tensor's type and squared error against the F32 values (llama.cpp's
bytes dequantized by gguf-py) recorded.  The tests compare our quantizers' error on the same F32
tensors with these numbers, or run llama-quantize themselves where ``KT_LLAMA_CPP_DIR`` names a
built tree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "fixtures" / "llamacpp" / "iq4_reference.json"
MODELS = ("qwen3moe-tiny", "deepseek2-tiny")
PRESETS = ("IQ4_XS", "IQ4_NL")


def quantize_bin(llama_cpp: Path) -> Path | None:
    for p in (llama_cpp / "build" / "bin" / "llama-quantize", llama_cpp / "build-llama-py" / "bin" / "llama-quantize"):
        if p.is_file():
            return p
    return None


def write_f32(hf_dir: Path, out: Path) -> Path:
    from ktransformers.convert import convert

    return convert(hf_dir, out, "F32", "F32", "F32", tokenizer=False)


def tensor_errors(f32_gguf: Path, quant_gguf: Path) -> dict[str, list]:
    """{tensor: [ggml type name, sum of squared error vs the F32 file]} of a quantized file."""
    import gguf
    import numpy as np

    ref = {t.name: t for t in gguf.GGUFReader(str(f32_gguf)).tensors}
    out = {}
    for t in gguf.GGUFReader(str(quant_gguf)).tensors:
        x = np.asarray(ref[t.name].data, dtype=np.float32).reshape(-1)
        y = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(-1)
        out[t.name] = [t.tensor_type.name, float(((y.astype(np.float64) - x) ** 2).sum())]
    return out


def llama_quantize(llama_cpp: Path, f32_gguf: Path, preset: str, out: Path, threads: int = 2) -> Path:
    subprocess.run([str(quantize_bin(llama_cpp)), str(f32_gguf), str(out), preset, str(threads)], check=True,
                   capture_output=True)
    return out


def main(llama_cpp: Path) -> None:
    import tempfile

    shared = ROOT.parent / "shared" / "fixtures"
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            f32 = write_f32(shared / name / "hf", Path(tmp) / f"{name}-F32.gguf")
            for preset in PRESETS:
                q = llama_quantize(llama_cpp, f32, preset, Path(tmp) / f"{name}-{preset}.gguf")
                result.setdefault(name, {})[preset] = tensor_errors(f32, q)
    REFERENCE.write_text(json.dumps({"made_with": "llama-quantize (llama.cpp 0c1e570, ggml 0.25.3), no imatrix",
                                     "models": result}, indent=1) + "\n")
    print(REFERENCE)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
