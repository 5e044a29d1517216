"""GGUF helpers for tests: re-type a quantized GGUF to F32 so llama.cpp and mlxtoy run the
exact same weights (llama.cpp would otherwise use its quantized kernels, we dequantize)."""

from __future__ import annotations

import os

import numpy as np

import mlxtoy  # noqa: F401  (fast BLAS before mlx.core)


def copy_gguf_metadata(reader, writer, old_arch: str | None = None, new_arch: str | None = None,
                       file_type=None) -> None:
    """Every key/value of `reader` into `writer` with its GGUF types (the writer adds the
    architecture itself). Keys of `old_arch` are renamed to `new_arch`; `file_type` replaces
    general.file_type when given."""
    import gguf

    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds these itself
        if name == "general.file_type" and file_type is not None:
            writer.add_file_type(file_type)
            continue
        if old_arch and new_arch and name.startswith(old_arch + "."):
            name = new_arch + name[len(old_arch):]
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), main, sub_type=sub)


def retype_gguf_to_f32(src: str, dst: str) -> str:
    """Write `dst`: `src` with every tensor dequantized to F32 by mlxtoy's dequantizer
    (gguf.quants.dequantize underneath) and all metadata copied. Returns dst.

    Written to a temporary name and renamed, so an interrupted run never leaves a half file.
    """
    import gguf

    from mlxtoy.io.gguf_read import dequantize_tensor

    reader = gguf.GGUFReader(src, "r")
    arch = reader.fields["general.architecture"].contents()
    tmp = f"{dst}.tmp{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, arch)
    copy_gguf_metadata(reader, writer, file_type=gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        arr = dequantize_tensor(t, src)  # numpy shape (reversed ne), float32
        writer.add_tensor(t.name, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst
