"""Token ids follow one rule from the tokenizer to the worker: below the model's vocab_size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from rill.services.tokenizer.service import RequestError, Tokenizer
from rill.shared.request_params import ChatMessage, SamplingParams
from rill.shared.schema import GenerateRequest


def test_ids_the_model_cannot_embed_are_refused_at_admission(tmp_path: Path, smollm2_dir: str) -> None:
    """A tokenizer that knows more ids than the model embeds (SmolLM2's 49152 against a config of
    1000): a prompt of ids, or text that tokenizes, beyond the embedding gets a 400 naming the
    field here, instead of failing the worker's whole batch later."""
    for f in Path(smollm2_dir).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    tok = Tokenizer(str(tmp_path), max_model_len=256)

    def req(**kw: object) -> GenerateRequest:
        return GenerateRequest(request_id="r", reply_to="x", params=SamplingParams(max_tokens=4),
                               arrival_time=0.0, **kw)  # type: ignore[arg-type]

    assert tok(req(kind="completion", prompt=[5, 999])).prompt_token_ids == [5, 999]
    def params(**kw: object) -> GenerateRequest:
        return msgspec.structs.replace(req(kind="completion", prompt=[5]), params=SamplingParams(max_tokens=4, **kw))

    for bad, param in ((req(kind="completion", prompt=[5, 1000]), "prompt"),
                       (params(stop_token_ids=[1000]), "stop_token_ids"),
                       (params(allowed_token_ids=[3, 1000]), "allowed_token_ids"),
                       (params(logit_bias={1000: 1.0}), "logit_bias"),
                       (req(kind="completion", prompt="a sentence of common English words"), "prompt"),
                       (req(kind="chat", messages=[ChatMessage(role="user", content="hello there")]), "messages")):
        with pytest.raises(RequestError) as err:
            tok(bad)
        assert err.value.param == param and "out of range [0, 1000)" in str(err.value)


def test_bad_words_become_each_form_of_the_word(smollm2_dir: str) -> None:
    """As text opens with it and after a space (both, where the spaced form is one token and the
    bare two); a word that is only whitespace is refused."""
    tok = Tokenizer(smollm2_dir, max_model_len=256)

    def enc(text: str) -> list[int]:
        return tok.tok.encode(text, add_special_tokens=False)

    assert len(enc("Danube")) != len(enc(" Danube"))
    assert tok.bad_word_ids(["Danube", " the"]) == [enc("Danube"), enc(" Danube"), enc("the"), enc(" the")]
    got = tok(GenerateRequest(request_id="r", reply_to="x", kind="completion", prompt="a", arrival_time=0.0,
                              params=SamplingParams(max_tokens=4, bad_words=["Danube"]))).params
    assert got.bad_word_ids == [enc("Danube"), enc(" Danube")] and got.bad_words == []
    with pytest.raises(RequestError) as err:
        tok.bad_word_ids(["\n "])
    assert err.value.param == "bad_words"


FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def test_a_suffix_is_filled_in_the_middle_in_the_models_format(tmp_path: Path, smollm2_dir: str) -> None:
    """Completions' suffix: prompt and suffix after their FIM markers, then the middle's, as
    transformers tokenizes the same text with the markers written out (Qwen2.5-Coder's format,
    added to SmolLM2's vocabulary here); a model without FIM tokens refuses the field by name (the
    gateway refuses truncate_prompt_tokens beside it, with echo's rule: test_openai_surface)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    for f in Path(smollm2_dir).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    rust = RustTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rust.add_special_tokens([AddedToken(t, special=True) for t in FIM])
    rust.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": rust.get_vocab_size()}))
    tok = Tokenizer(str(tmp_path), max_model_len=256)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    prompt, suffix = "def area(r):\n    return", "\n\nprint(area(2.0))\n"

    def req(**kw: object) -> GenerateRequest:
        return GenerateRequest(request_id="r", reply_to="x", kind="completion", arrival_time=0.0,
                               params=SamplingParams(max_tokens=4), **kw)  # type: ignore[arg-type]

    want = hf.encode(f"{FIM[0]}{prompt}{FIM[1]}{suffix}{FIM[2]}", add_special_tokens=True)
    assert tok(req(prompt=prompt, suffix=suffix)).prompt_token_ids == want
    assert want[0] == tok.fim[0] and want[-1] == tok.fim[2] and len(set(tok.fim)) == 3
    ids = hf.encode(prompt, add_special_tokens=False)
    assert tok(req(prompt=ids, suffix=suffix)).prompt_token_ids == want  # ids are taken as given
    plain = Tokenizer(smollm2_dir, max_model_len=256)
    assert plain.fim is None
    with pytest.raises(RequestError) as err:
        plain(req(prompt=prompt, suffix=suffix))
    assert err.value.param == "suffix"


def test_a_model_without_a_chat_template_says_so_at_start(tmp_path: Path, smollm2_dir: str, redis_url: str,
                                                          prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A base model (Gemma 3 270M's GGUF, say) serves completions; its chat requests are 400s, and
    the start-up log says so once rather than leaving the first chat request to find out."""
    import logging

    from rill.services.tokenizer.service import run
    from rill.shared.lifecycle import StopFlag

    for f in Path(smollm2_dir).iterdir():
        if f.suffix != ".safetensors" and f.name != "chat_template.jinja":
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    stop = StopFlag(install=False)
    stop.set()
    with caplog.at_level(logging.INFO, logger="rill.tokenizer"):
        run(redis_url, prefix, str(tmp_path), 256, "t0", stop=stop)
    said = [r for r in caplog.records if "no chat template" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "--chat-template" in said[0].getMessage()
    with pytest.raises(RequestError) as err:
        Tokenizer(str(tmp_path), 256)(GenerateRequest(request_id="r", reply_to="x", kind="chat", arrival_time=0.0,
                                                      messages=[ChatMessage(role="user", content="hi")],
                                                      params=SamplingParams(max_tokens=4)))
    assert err.value.param == "messages" and "no chat template" in str(err.value)
