"""A model folder's tokenizer, loaded with the `tokenizers` library alone (no transformers, no torch).

Tokenizer and detokenizer replicas are what an autoscaler adds under load, so they load only
tokenizer.json (Rust) and read the rest from the JSON files beside it. The rules below are the
ones transformers' fast tokenizer applies on load, so ids and special tokens agree with
`AutoTokenizer.from_pretrained` (tests/test_chat_template.py checks it):

* named special tokens (bos_token, eos_token, ...) come from tokenizer_config.json, as strings or
  as serialized AddedTokens; any the tokenizer lacks are added as special tokens, as are entries
  of `added_tokens_decoder` that tokenizer.json lacks;
* with an explicit `add_bos_token` / `add_eos_token` in tokenizer_config.json, or no
  post-processor in tokenizer.json, the post-processor becomes the BOS/EOS template transformers
  builds (`TokenizersBackend.update_post_processor`);
* the ids that end generation are the union of config.json's and generation_config.json's
  `eos_token_id` and the tokenizer's eos token.

Not reproduced: transformers' Mistral pre-tokenizer regex patch (for a few Mistral checkpoints
with a known-bad regex) and per-class rebuilds of a tokenizer from vocab files (slow tokenizers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file is absent."""
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


@dataclass(frozen=True)
class ModelTokenizer:
    """The Rust tokenizer of a model folder and the facts read beside it."""

    tokenizer: Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, ... -> text, as chat templates see them
    eos_token_ids: list[int]  # every id that ends generation
    config: dict[str, Any]  # tokenizer_config.json as read (the chat template may be in it)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir: str | Path) -> ModelTokenizer:
    folder = Path(model_dir)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = read_json(folder / "tokenizer_config.json")
    special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    _add_missing_tokens(tok, config, special)
    if "add_bos_token" in config or "add_eos_token" in config or tok.post_processor is None:
        _bos_eos_post_processor(tok, special, bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))
    eos = set(_as_list(read_json(folder / "config.json").get("eos_token_id")))
    eos |= set(_as_list(read_json(folder / "generation_config.json").get("eos_token_id")))
    if "eos_token" in special and (eos_id := tok.token_to_id(special["eos_token"])) is not None:
        eos.add(eos_id)
    return ModelTokenizer(tok, special, sorted(eos), config)


def _add_missing_tokens(tok: Tokenizer, config: dict[str, Any], special: dict[str, str]) -> None:
    known = {t.content for t in tok.get_added_tokens_decoder().values()}
    extra: list[AddedToken] = []
    decoder = config.get("added_tokens_decoder") or {}
    for _, entry in sorted(((int(i), e) for i, e in decoder.items()), key=lambda kv: kv[0]):
        if isinstance(entry, dict) and entry.get("content") not in known:
            extra.append(AddedToken(entry["content"], single_word=entry.get("single_word", False),
                                    lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                                    normalized=entry.get("normalized", False), special=entry.get("special", True)))
            known.add(entry["content"])
    for text in special.values():
        if text not in known:
            extra.append(AddedToken(text, special=True, normalized=False))
            known.add(text)
    if extra:
        tok.add_tokens(extra)


def _bos_eos_post_processor(tok: Tokenizer, special: dict[str, str], add_bos: bool, add_eos: bool) -> None:
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    pairs = [(t, tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=pairs)


# Fill-in-the-middle markers by family, in prefix-suffix-middle order: StarCoder's (and its
# descendants'), Qwen2.5-Coder's and CodeGemma's, DeepSeek-Coder's.
FIM_MARKERS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
               ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
               ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))


def fim_tokens(tok: ModelTokenizer) -> tuple[int, int, int] | None:
    """The ids of the first family's FIM markers that the vocabulary holds all of, else None."""
    for names in FIM_MARKERS:
        ids = [tok.tokenizer.token_to_id(name) for name in names]
        if None not in ids:
            return ids[0], ids[1], ids[2]
    return None
