"""The compressed token map of DeepSeek V4.1 (``build_compressed_token_map``):
tokenizer ids whose normalised text is equal share one compressed id.

For every token id in ascending order: ``text = decode([id])`` (special
tokens kept); if the text holds U+FFFD (a partial UTF-8 byte token) the key
is the raw token string, else the normalised text, or the text itself when
normalising leaves "".  Compressed ids are handed out in order of first
appearance of a key.  The normaliser is V4.1's sequence of Hugging Face
``tokenizers`` normalisers.  ``tokenizers`` is the optional extra
``numa_engram[tokenizer]``.  No torch here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import SpecError

PRIVATE_SPACE = "\ue000"  # keeps a lone-space token from collapsing to ""


def v41_normalizer() -> Any:
    """NFKC, NFD, StripAccents, Lowercase, whitespace runs -> " ", a lone
    space -> U+E000, Strip, U+E000 -> " "."""
    try:
        from tokenizers import Regex, normalizers
    except ImportError as exc:
        raise SpecError("build_token_map needs the 'tokenizers' package: pip install "
                        "'numa_engram[tokenizer]'") from exc
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex("[ \t\r\n]+"), " "),
        normalizers.Replace(Regex("^ $"), PRIVATE_SPACE), normalizers.Strip(),
        normalizers.Replace(PRIVATE_SPACE, " ")])


def _surface(tokenizer: Any) -> tuple[int, Any, Any]:
    """(vocabulary size, decode one id, raw token of one id) of a
    ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer."""
    if hasattr(tokenizer, "get_vocab_size") and hasattr(tokenizer, "id_to_token"):
        return (tokenizer.get_vocab_size(with_added_tokens=True),
                lambda i: tokenizer.decode([i], skip_special_tokens=False),
                tokenizer.id_to_token)
    if hasattr(tokenizer, "convert_ids_to_tokens") and hasattr(tokenizer, "decode"):
        return (len(tokenizer), lambda i: tokenizer.decode([i], skip_special_tokens=False),
                tokenizer.convert_ids_to_tokens)
    raise SpecError(f"{type(tokenizer).__name__} is neither a tokenizers.Tokenizer nor a "
                    "transformers tokenizer")


def build_token_map(tokenizer: Any) -> tuple[np.ndarray, int]:
    """(int64 map tokenizer id -> compressed id, compressed vocab size)."""
    normalizer = v41_normalizer()
    size, decode, raw_token = _surface(tokenizer)
    keys: dict[str, int] = {}
    out = np.empty(size, dtype=np.int64)
    for token_id in range(size):
        text = decode(token_id)
        if "\ufffd" in text:
            key = raw_token(token_id)
            key = f"\0missing {token_id}" if key is None else key
        else:
            key = normalizer.normalize_str(text) or text
        out[token_id] = keys.setdefault(key, len(keys))
    return out, len(keys)
