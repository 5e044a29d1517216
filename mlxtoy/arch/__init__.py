"""Architectures as data: one `ArchSpec` per architecture (`mlxtoy.arch.<name>.SPEC`).

A spec says how to build the module, how to read and write the architecture's GGUF metadata
and Hugging Face config, its one name table (ours <-> GGUF <-> HF, with the tensor transforms
between them) and its LoRA targets. `mlxtoy.arch.registry` collects them; the GGUF and HF
readers and writers (`mlxtoy.io`), `mlxtoy.export` and `mlxtoy.loading` loop over a spec and
never branch on an architecture's name.

The architecture names are `mlxtoy.model_config.SUPPORTED_ARCHS` (MLX-free, for the configs).
"""
