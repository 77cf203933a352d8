"""The converter: a Hugging Face safetensors folder written as one GGUF file with llama.cpp's names,
metadata and (quantized) types; ``python -m ktransformers.convert`` is its command line (:mod:`.cli`).

Architectures: llama (and Mixtral, written as llama.cpp does: ``llama`` arch with ``ffn_*_exps``),
qwen2, qwen3, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3 (split MLA ``attn_k_b``/``attn_v_b``
like current llama.cpp), gemma3 (text), qwen3_next and qwen3_5_moe_text (``qwen35moe``, the DeltaNet's V heads reordered as
llama.cpp does) as llama.cpp's converter with ``--no-mtp`` (the MTP block is not part of the
transformers model), deepseek_v4 (``deepseek4``: the hash
router's ``tid2eid`` tables I32; llama.cpp's converter writes the routed experts MXFP4, which
``--experts MXFP4`` matches).

The steps, a module each: :mod:`.policy` (which type each tensor gets), :mod:`.checkpoint` (reading
the folder), :mod:`.tensor_plan` (the GGUF tensors, names and producers), :mod:`.metadata` (llama.cpp's
keys), :mod:`.light` (planning without torch or transformers), :mod:`.writer` (streaming the file),
:mod:`.pipeline` (:func:`convert`, all of them in order), :mod:`.cli`.
"""

from .checkpoint import Checkpoint
from .cli import main
from .light import LIGHT_MODEL_TYPES
from .metadata import metadata_for
from .pipeline import convert
from .policy import PRESETS, UNWRITABLE_PRESETS, PresetPolicy, TypePolicy, fit_type
from .tensor_plan import PlannedTensor, arch_of, plan
from .writer import write_gguf

__all__ = [
    "LIGHT_MODEL_TYPES", "PRESETS", "UNWRITABLE_PRESETS", "Checkpoint", "PlannedTensor", "PresetPolicy",
    "TypePolicy", "arch_of", "convert", "fit_type", "main", "metadata_for", "plan", "write_gguf",
]
