"""Write a GGUF with llama.cpp's own converter classes (``convert_hf_to_gguf.py``), vocabulary left out.

The tiny models' byte-level tokenizer is not one llama.cpp's converter recognises, so the family's
model class is used as it is except for ``set_vocab`` (``tokenizer.ggml.model = none``); names,
metadata and tensor transforms are llama.cpp's.

    python tests/llama_cpp_convert.py LLAMA_CPP_DIR HF_DIR OUT.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(llama_cpp: Path, hf_dir: Path, out: Path) -> None:
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

        def set_vocab(self):
            self.gguf_writer.add_tokenizer_model("none")

    with torch.inference_mode():
        WithoutVocab(hf_dir, gguf.LlamaFileType.ALL_F32, out).write()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
