"""Write a GGUF with llama.cpp's own converter classes (``convert_hf_to_gguf.py``), vocabulary left out.

The tiny models' byte-level tokenizer is not one llama.cpp's converter recognises, so the family's
model class is used as it is except for ``set_vocab`` (``tokenizer.ggml.model = none``); names,
metadata and tensor transforms are llama.cpp's.  The tiny models have no MTP block, so the
families whose converter otherwise requires one (Qwen3-Next, Qwen3.5-MoE) are written as with ``--no-mtp``.

    python tests/llama_cpp_convert.py LLAMA_CPP_DIR HF_DIR OUT.gguf [f32|f16|bf16]
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str = "f32") -> None:
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    import gguf
    import torch

    import convert_hf_to_gguf as conv
    from conversion import ModelBase, ModelType

    hparams = ModelBase.load_hparams(hf_dir, False)
    base = conv.get_model_class(conv.get_model_architecture(hparams, ModelType.TEXT), mmproj=False)

    class WithoutVocab(base):
        model_arch = base.model_arch
        no_mtp = base.no_mtp or hparams.get("model_type") in ("qwen3_next", "qwen3_5_moe_text")

        def set_vocab(self):
            self.gguf_writer.add_tokenizer_model("none")

    with torch.inference_mode():
        ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]
        WithoutVocab(hf_dir, ftype, out).write()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:5])
