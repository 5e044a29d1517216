"""llama.cpp's pre-tokenizers for byte-level BPE ("gpt2" GGUF vocabularies), as HF pieces.

- `PRE_TOKENIZERS`: GGUF `tokenizer.ggml.pre` name -> `PreTokenizer` (its regex list and the
  flags llama.cpp ties to it), from llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe);
- `PreTokenizer.to_hf()`: the equivalent HF `tokenizers` pre-tokenizer;
- `detect_pre`: the reverse, naming the preset that a tokenizer.json's pre-tokenizer equals
  (what we write as `tokenizer.ggml.pre` when exporting a Hugging Face tokenizer).
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Iterable

from tokenizers import Regex, pre_tokenizers

# llama.cpp rewrites some HF regexes for std::regex (case-insensitive groups, \p{Lu} classes);
# HF's Oniguruma handles the originals, so where they differ we keep the original form.

# GPT-2's regex. llama.cpp's string lacks the final `|\s+`, but its hand-written matcher for it
# (unicode_regex_split_custom_gpt2) does have that branch, as HF's ByteLevel regex does.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
           r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
               r"|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DEEPSEEK_V3_WORDS = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                      r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class PreTokenizer:
    """One llama.cpp pre-tokenizer: its regexes (applied in turn) and the flags it sets."""

    def __init__(self, regexes: list[str], ignore_merges: bool = False, add_bos: bool = False):
        self.regexes = regexes
        self.ignore_merges = ignore_merges  # a word that is already a token skips the merges
        self.add_bos = add_bos              # llama.cpp's default when add_bos_token is absent

    def to_hf(self) -> Any:
        """The HF pre-tokenizer: llama.cpp splits each piece of the previous regex and keeps the
        unmatched gaps (Split "isolated"), then maps bytes to the byte-level alphabet."""
        return pre_tokenizers.Sequence(
            split_pretokenizers(self.regexes)
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


_PRE_GROUPS: list[tuple[tuple[str, ...], PreTokenizer]] = [
    (("default",), PreTokenizer([r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"])),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt",
      "olmo", "jais", "trillion", "granite-docling"), PreTokenizer([GPT2_REGEX])),
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"), PreTokenizer([_LLAMA3], ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizer([_LLAMA3])),
    (("falcon",), PreTokenizer([r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, r"[0-9][0-9][0-9]"])),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
     PreTokenizer([r"\p{N}", GPT2_REGEX])),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "megrez", "solar-open"),
     PreTokenizer([_QWEN2])),
    (("qwen35",), PreTokenizer([_QWEN35])),
    (("chatglm-bpe",), PreTokenizer([_LLAMA3])),
    (("glm4", "glm5"), PreTokenizer([_LLAMA3], ignore_merges=True)),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer([_BLOOM])),
    (("viking",), PreTokenizer([_BLOOM, r"\p{N}"])),
    (("deepseek-coder",),
     PreTokenizer([r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"])),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm"),
     PreTokenizer([r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK_V3_WORDS])),
    (("tekken",), PreTokenizer([_TEKKEN], ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie"), PreTokenizer([_GPT4O])),
    (("seed-coder",), PreTokenizer([_SEED_CODER])),
]
# Within a group the regexes are identical; the first name is the one written when exporting a
# Hugging Face tokenizer (e.g. "smollm" over "starcoder": llama.cpp then leaves decoded spaces
# alone, and "llama-bpe" is what llama.cpp's own converter writes for Llama 3).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _PRE_GROUPS for name in names}


def split_pretokenizers(regexes: Iterable[str]) -> list[Any]:
    return [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]


# HF writes some regexes in the (?i:...) form llama.cpp spells out; map both to one name.
_HF_ALIASES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)": r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
}


def detect_pre(pre: dict[str, Any] | None, source: str) -> str:
    """Name the llama.cpp pre-tokenizer whose regex list equals this HF pre-tokenizer's.

    `pre` is tokenizer.json's "pre_tokenizer" node; no match warns and gives "default".
    """
    regexes: list[str] = []

    def walk(node: dict[str, Any] | None) -> None:
        if not node:
            return
        kind = node.get("type")
        if kind == "Sequence":
            for sub in node.get("pretokenizers", []):
                walk(sub)
        elif kind == "Split":
            pat = node.get("pattern", {})
            regexes.append(pat.get("Regex") or re.escape(pat.get("String", "")))
        elif kind == "Digits":
            regexes.append(r"\p{N}" if node.get("individual_digits") else r"\p{N}+")
        elif kind == "ByteLevel" and node.get("use_regex", True):
            regexes.append(GPT2_REGEX)

    walk(pre)
    normalized = []
    for r in regexes:
        for hf_form, cpp_form in _HF_ALIASES.items():
            r = r.replace(hf_form, cpp_form)
        normalized.append(r)
    for names, p in _PRE_GROUPS:
        if p.regexes == normalized:
            return names[0]
    warnings.warn(f"{source}: pre-tokenizer matches no llama.cpp preset; writing 'default'",
                  stacklevel=3)
    return "default"
