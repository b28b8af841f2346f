"""The GGUF files of the quantization benchmark, made from the bundled SmolLM2 Q4_1 GGUF with ``gguf``'s writer.

:func:`requantized_gguf` rewrites every tensor stored in the file's main format (Q4_1: every block linear)
in another GGUF block format (Q8_0, Q4_0): dequantized with ``gguf.quants.dequantize`` and quantized again
with ``gguf.quants.quantize`` (ggml's reference quantizers, what ``llama-quantize`` runs for these types).
The other tensors (the Q8_0 token embedding, the F32 norms) and all metadata (tokenizer, chat template) are
copied unchanged, ``general.file_type`` is set to the new type. Requantizing keeps the Q4_1 file's rounding
and adds the new format's: a Q8_0 made this way is within ~0.4 % of each block's range of the Q4_1 weights
(not of the original bf16 model, which is not shipped), a Q4_0 adds a second 4-bit rounding. Both xLLM and
llama.cpp read the same files, so the comparison is on identical weights.
"""

from __future__ import annotations

import pathlib

_FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1"}


def requantized_gguf(src: pathlib.Path, qtype: str, out_dir: pathlib.Path) -> pathlib.Path:
    """``src`` with its main-format tensors in ``qtype`` at ``out_dir/<stem>-<qtype>.gguf`` (made once; the
    source itself when it already is in ``qtype``)."""
    import gguf
    import numpy as np

    qtype = qtype.upper()
    if qtype not in _FILE_TYPES:
        raise ValueError(f"requantize to {qtype}: supported {sorted(_FILE_TYPES)}")
    reader = gguf.GGUFReader(str(src))
    counts: dict[int, int] = {}
    for t in reader.tensors:
        if len(t.shape) == 2:
            counts[int(t.tensor_type)] = counts.get(int(t.tensor_type), 0) + 1
    main = gguf.GGMLQuantizationType(max(counts, key=counts.get))
    target = gguf.GGMLQuantizationType[qtype]
    if main == target:
        return src
    out = out_dir / f"{src.stem}-{qtype}.gguf"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType[_FILE_TYPES[qtype]])
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type == main and len(t.shape) == 2:
            floats = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            writer.add_tensor(t.name, gguf.quants.quantize(floats, target), raw_dtype=target)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out
