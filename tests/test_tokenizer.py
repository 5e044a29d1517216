"""mlxtoy.io.tokenizer against llama.cpp (llama-cpp-python, vocab-only loads).

Two vocabularies: the real SmolLM2 GGUF (byte-level BPE, "smollm" pre-tokenizer) and a tiny
SentencePiece ("llama" model) GGUF written here with gguf-py.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

import pytest

from mlxtoy.errors import UserError
from mlxtoy.io.tokenizer import Tokenizer

import llama_cpp
import gguf

SMOLLM2_CACHE = Path("/root/.cache/mlxtoy/models/SmolLM2-135M-Instruct.Q4_1.gguf")

MIXED_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n\tif a:\n\t\tpass\n",
    "Café, naïve résumé, Ærøskøbing, Straße",
    "中文字符 日本語のテキスト 한국어",
    "emoji 🤖🎉👍🏽 and flags 🇫🇷",
    "numbers 12345 3.14159 1,000,000 ½ ³",
    "multiple   spaces\n\n\nand newlines  \n  end   ",
    "it's don't we'll I'M they've",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|> <reponame>x",
    "",
    " ",
    "\n",
]
MIXED = "".join(MIXED_TEXTS)


# ----------------------------------------------------------------------------- helpers


def _vocab_llama(path: str):
    return llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)


def _llama_piece(llm, token: int) -> bytes:
    """llama.cpp's token_to_piece(special=True); llama-cpp-python's detokenize caps a token
    at 32 bytes, so call the C function with a larger buffer."""
    import ctypes

    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    buf = (ctypes.c_char * 1024)()
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
    assert 0 <= n <= len(buf)
    return bytes(buf[:n])


def _llama_detokenize(llm, ids: list[int], special: bool) -> str:
    """llama.cpp's llama_detokenize (remove_special=False)."""
    import ctypes

    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    buf = (ctypes.c_char * 4096)()
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, special)
    assert 0 <= n <= len(buf)
    return bytes(buf[:n]).decode()


def _metadata(path: str) -> dict[str, Any]:
    r = gguf.GGUFReader(path)
    md = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        v = f.contents()
        md[k] = v.item() if hasattr(v, "item") else v
    return md


def _write_vocab_gguf(path: str, md: dict[str, Any]) -> None:
    """A llama-arch GGUF with no tensors: hyperparameters plus the given tokenizer keys.

    llama.cpp's vocab_only load reads the hyperparameters and vocabulary and never looks for
    tensors, so none are written.
    """
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in md.items():
        if key == "tokenizer.ggml.tokens":
            w.add_token_list(value)
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types(value)
        elif key == "tokenizer.ggml.scores":
            w.add_token_scores(value)
        elif key == "tokenizer.ggml.merges":
            w.add_token_merges(value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            raise TypeError(f"{key}: {type(value)}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _train_pieces(corpus: str, n_merges: int) -> list[str]:
    """A few hundred SentencePiece-like pieces ("▁the", "▁t", "he", ...), by plain BPE counts."""
    words = collections.Counter("\u2581" + w for w in corpus.split())
    seqs = {w: list(w) for w in words}
    pieces: list[str] = []
    for _ in range(n_merges):
        pairs: collections.Counter = collections.Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return pieces


SPM_CORPUS = """the quick brown fox jumps over the lazy dog . the cat sat on the mat and then the
dog ran after the cat into the garden where there were three thin thistles thrown there
hello world this is a tokenizer test with some english words like testing tested tester
international interesting interest interior internal internet intern into in on an and
Hello World The Quick Brown Fox , ! ? it's"""


def _spm_metadata(add_space_prefix: bool | None) -> dict[str, Any]:
    pieces = _train_pieces(SPM_CORPUS, 400)
    chars = sorted(set(SPM_CORPUS.replace("\n", " ").replace(" ", "")) | {"\u2581"})
    tokens = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + pieces
              + ["<|im_start|>", "<|user|>"])
    types = [2, 3, 3] + [6] * 256 + [1] * len(chars) + [1] * len(pieces) + [3, 4]
    # distinct scores: merged pieces by training order; single characters never win a merge
    scores = ([0.0] * 259 + [-1000.0 - i for i in range(len(chars))]
              + [-float(i) for i in range(len(pieces))] + [0.0, 0.0])
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    if add_space_prefix is not None:
        md["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return md


SPM_TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "Hello World, the interesting internet!",
    "  leading and  double  spaces ",
    "café naïve Straße",            # accents: byte fallback
    "emoji 🤖 and 中文",             # 4-byte and CJK characters: byte fallback
    "tab\there\nnew line\n",
    "<s>hello</s>",
    "a<|im_start|>b c",
    "x<|user|>y",
    "<|im_start|> the",
    "",
]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smollm2_gguf() -> str:
    if SMOLLM2_CACHE.exists():
        return str(SMOLLM2_CACHE)
    try:
        from mlxtoy.io.registry import default_model_path

        return str(default_model_path(quiet=True))
    except Exception as e:  # offline, or the registry is not available
        pytest.skip(f"SmolLM2 GGUF not available: {e}")


@pytest.fixture(scope="module")
def smollm2_md(smollm2_gguf) -> dict[str, Any]:
    return _metadata(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, smollm2_md) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm2_md, source=smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_llama(smollm2_gguf):
    return _vocab_llama(smollm2_gguf)


@pytest.fixture(scope="module", params=[None, False], ids=["space-prefix-default", "no-space-prefix"])
def spm(request, tmp_path_factory):
    """(metadata, GGUF path, llama.cpp vocab) for the tiny SentencePiece vocabulary."""
    md = _spm_metadata(request.param)
    path = str(tmp_path_factory.mktemp("spm") / "spm.gguf")
    _write_vocab_gguf(path, md)
    return md, path, _vocab_llama(path)


# ----------------------------------------------------------------------------- SmolLM2 (BPE)

@pytest.mark.real
@pytest.mark.parametrize("parse_special", [True, False])
def test_smollm2_ids_match_llama_cpp(smollm2, smollm2_llama, parse_special):
    for text in MIXED_TEXTS + [MIXED]:
        ref = smollm2_llama.tokenize(text.encode(), add_bos=True, special=parse_special)
        assert smollm2.encode(text, parse_special=parse_special) == ref, text
        ref = smollm2_llama.tokenize(text.encode(), add_bos=False, special=parse_special)
        assert smollm2.encode(text, add_bos=False, parse_special=parse_special) == ref, text


@pytest.mark.real
def test_smollm2_special_tokens_are_single_ids(smollm2):
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == smollm2.token_to_id("<|im_start|>") == 1
    assert ids[-1] == smollm2.token_to_id("<|im_end|>") == 2
    assert 1 not in smollm2.encode("<|im_start|>", parse_special=False)


@pytest.mark.real
def test_smollm2_decode_matches_llama_cpp(smollm2, smollm2_llama):
    for text in MIXED_TEXTS + [MIXED]:
        ids = smollm2.encode(text)
        assert smollm2.decode(ids) == text
        assert smollm2.decode(ids) == smollm2_llama.detokenize(ids, special=True).decode()
        assert smollm2.decode(ids, skip_special=True) == \
            smollm2_llama.detokenize(ids, special=False).decode()
        # token by token, the raw bytes join to the text (streaming detokenization)
        assert b"".join(smollm2.decode_token_bytes(i) for i in ids) == text.encode()


@pytest.mark.real
def test_smollm2_token_bytes_match_llama_cpp(smollm2, smollm2_llama):
    # every token's bytes, including ones that are half a UTF-8 character
    for i in range(smollm2.vocab_size):
        assert smollm2.decode_token_bytes(i) == _llama_piece(smollm2_llama, i), i


@pytest.mark.real
def test_smollm2_ids_and_flags(smollm2, smollm2_llama):
    assert smollm2.vocab_size == smollm2_llama.n_vocab() == 49152
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.pad_id) == (1, 2, 2)
    assert smollm2.bos_id == smollm2_llama.token_bos() and smollm2.eos_id == smollm2_llama.token_eos()
    assert smollm2.add_bos is False and smollm2.encode("hi")[0] != smollm2.bos_id
    assert smollm2.encode("hi", add_bos=True)[0] == smollm2.bos_id
    # our stop set: eos, <|im_end|>, <|endoftext|>; all of them stop llama.cpp too
    vocab = llama_cpp.llama_model_get_vocab(smollm2_llama._model.model)
    assert {0, 2} <= smollm2.eos_ids
    assert all(llama_cpp.llama_vocab_is_eog(vocab, i) for i in smollm2.eos_ids)


@pytest.mark.real
def test_smollm2_chat_template(smollm2):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert smollm2.apply_chat_template(msgs) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    assert smollm2.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n")


@pytest.mark.real
def test_smollm2_gguf_metadata_unchanged(smollm2, smollm2_md):
    expected = {k: v for k, v in smollm2_md.items() if k.startswith("tokenizer.")}
    assert smollm2.to_gguf_metadata() == expected


@pytest.mark.real
def test_smollm2_hf_round_trip(smollm2, smollm2_md, tmp_path):
    """GGUF -> tokenizer.json -> HF folder -> GGUF keys -> llama.cpp: same ids all the way."""
    from tokenizers import Tokenizer as HFTokenizer

    (tmp_path / "tokenizer.json").write_text(smollm2.to_hf_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(smollm2.to_hf_tokenizer_config()))
    plain_hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    back = Tokenizer.from_hf_folder(tmp_path)
    for text in MIXED_TEXTS + [MIXED]:
        ids = smollm2.encode(text)
        assert plain_hf.encode(text).ids == ids
        assert back.encode(text) == ids
        assert back.encode(text, parse_special=False) == smollm2.encode(text, parse_special=False)
        assert back.decode(ids) == text
    assert back.chat_template == smollm2.chat_template
    assert (back.bos_id, back.eos_id, back.pad_id, back.add_bos) == (1, 2, 2, False)

    md = back.to_gguf_metadata()
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert md[key] == smollm2_md[key], key
    path = str(tmp_path / "vocab.gguf")
    _write_vocab_gguf(path, md)
    llm = _vocab_llama(path)
    assert llm.tokenize(MIXED.encode(), add_bos=True, special=True) == smollm2.encode(MIXED)


# ----------------------------------------------------------------------------- SentencePiece


@pytest.mark.parametrize("parse_special", [True, False])
def test_spm_ids_match_llama_cpp(spm, parse_special):
    md, path, llm = spm
    tok = Tokenizer.from_gguf_metadata(md, source=path)
    byte_ids = set(range(3, 259))
    used_bytes = False
    for text in SPM_TEXTS + ["".join(SPM_TEXTS)]:
        # add_bos=None: the vocabulary's default (llama.cpp adds BOS for SentencePiece)
        ref = llm.tokenize(text.encode(), add_bos=True, special=parse_special)
        assert tok.encode(text, parse_special=parse_special) == ref, text
        ref = llm.tokenize(text.encode(), add_bos=False, special=parse_special)
        ours = tok.encode(text, add_bos=False, parse_special=parse_special)
        assert ours == ref, text
        used_bytes |= bool(byte_ids & set(ours))
    assert used_bytes  # the texts did exercise byte fallback


def test_spm_merges_are_real(spm):
    md, path, _ = spm
    tok = Tokenizer.from_gguf_metadata(md, source=path)
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(text, add_bos=False)
    assert len(ids) < len(text) / 3  # whole words, not characters
    assert tok.token_text(tok.encode(" the", add_bos=False)[-1]) == "\u2581the"


def test_spm_decode_matches_llama_cpp(spm):
    md, path, llm = spm
    tok = Tokenizer.from_gguf_metadata(md, source=path)
    assert tok.add_bos and tok.bos_id == 1
    for text in SPM_TEXTS:
        ids = tok.encode(text)  # with BOS
        if tok.add_space_prefix:
            # llama-cpp-python drops the encoder's prefix space after BOS, as HF does
            assert tok.decode(ids) == llm.detokenize(ids, special=True).decode(), text
            assert tok.decode(ids, skip_special=True) == \
                llm.detokenize(ids, special=False).decode(), text
        else:
            # llama-cpp-python strips a leading space after BOS even without a prefix space;
            # llama.cpp's own detokenizer does not
            assert tok.decode(ids) == _llama_detokenize(llm, ids, special=True), text
            assert tok.decode(ids, skip_special=True) == _llama_detokenize(llm, ids, special=False), text
        for i in ids:
            assert tok.decode_token_bytes(i) == _llama_piece(llm, i), (text, i)
        if "<" not in text:  # special tokens get llama.cpp's space after them; plain text round-trips
            assert tok.decode(ids, skip_special=True) == text
            assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_spm_via_hf_folder_matches_llama_cpp(spm, tmp_path):
    """SentencePiece -> tokenizer.json -> HF folder -> GGUF with derived scores -> llama.cpp."""
    md, path, _ = spm
    tok = Tokenizer.from_gguf_metadata(md, source=path)
    (tmp_path / "tokenizer.json").write_text(tok.to_hf_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok.to_hf_tokenizer_config()))
    back = Tokenizer.from_hf_folder(tmp_path)
    assert back.kind == "spm" and back.add_space_prefix == tok.add_space_prefix
    derived = back.to_gguf_metadata()
    assert derived["tokenizer.ggml.tokens"] == md["tokenizer.ggml.tokens"]
    assert derived["tokenizer.ggml.token_type"] == md["tokenizer.ggml.token_type"]
    out = str(tmp_path / "derived.gguf")
    _write_vocab_gguf(out, derived)
    llm = _vocab_llama(out)
    for text in SPM_TEXTS:
        assert back.encode(text) == tok.encode(text), text
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == tok.encode(text), text


# ----------------------------------------------------------------------------- chat templates


def _tiny_bpe_md(**extra: Any) -> dict[str, Any]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + ["Ġt", "he", "Ġthe"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
          "tokenizer.ggml.eos_token_id": 0}
    md.update(extra)
    return md


HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{% set _ = messages.append({'role': 'x'}) %}ok",
    "{{ messages[0].clear() }}",
]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_chat_template_sandbox_blocks_code(template):
    tok = Tokenizer.from_gguf_metadata(_tiny_bpe_md(**{"tokenizer.chat_template": template}), "evil.gguf")
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(UserError, match="evil.gguf: chat template") as info:
        tok.apply_chat_template(messages)
    from jinja2.exceptions import SecurityError

    assert isinstance(info.value.__cause__, SecurityError)
    assert messages == [{"role": "user", "content": "hi"}]


def test_chat_template_helpers_and_fallback():
    tpl = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
           "{{ bos_token }}{{ strftime_now('%Y') | length }}{{ messages | tojson }}{{ eos_token }}")
    tok = Tokenizer.from_gguf_metadata(_tiny_bpe_md(**{"tokenizer.chat_template": tpl}), "t.gguf")
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == \
        '4[{"role": "user", "content": "é"}]<|endoftext|>'
    with pytest.raises(UserError, match="no system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])

    plain = Tokenizer.from_gguf_metadata(_tiny_bpe_md(), "t.gguf")
    assert plain.chat_template is None
    assert plain.apply_chat_template([{"role": "user", "content": "the"}]) == \
        "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    assert plain.encode("<|im_start|>the") == [1, plain.token_to_id("t"), plain.token_to_id("he")]
    assert 2 in plain.eos_ids and 0 in plain.eos_ids  # <|im_end|> ends turns


# ----------------------------------------------------------------------------- bad input


def test_errors_name_the_source():
    with pytest.raises(UserError, match=r"^m\.gguf: .*tokenizer\.ggml\.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"}, source="m.gguf")
    with pytest.raises(UserError, match=r"^m\.gguf: unsupported tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata(_tiny_bpe_md(**{"tokenizer.ggml.model": "bert"}), source="m.gguf")
    with pytest.raises(UserError, match=r"^m\.gguf: .*merges"):
        md = _tiny_bpe_md()
        del md["tokenizer.ggml.merges"]
        Tokenizer.from_gguf_metadata(md, source="m.gguf")
    with pytest.raises(UserError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder("/nonexistent-folder")


def test_unknown_pre_falls_back_to_gpt2():
    with pytest.warns(UserWarning, match="unknown pre-tokenizer 'weird'"):
        tok = Tokenizer.from_gguf_metadata(_tiny_bpe_md(**{"tokenizer.ggml.pre": "weird"}), "w.gguf")
    ref = Tokenizer.from_gguf_metadata(_tiny_bpe_md(), "g.gguf")
    assert tok.encode(" the the") == ref.encode(" the the") == [tok.token_to_id("Ġthe")] * 2


def test_empty_and_bos_eos_flags():
    tok = Tokenizer.from_gguf_metadata(
        _tiny_bpe_md(**{"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.add_bos_token": True,
                        "tokenizer.ggml.add_eos_token": True}), "t.gguf")
    assert tok.encode("") == [1, 0]
    assert tok.encode("", add_bos=False, add_eos=False) == []
    assert tok.encode(" the", add_bos=False) == [tok.token_to_id("Ġthe"), 0]
    assert os.path.basename(tok.source) == "t.gguf"
