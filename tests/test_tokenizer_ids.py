"""Token ids follow one rule from the tokenizer to the worker: below the model's vocab_size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    for bad, param in ((req(kind="completion", prompt=[5, 1000]), "prompt"),
                       (req(kind="completion", prompt="a sentence of common English words"), "prompt"),
                       (req(kind="chat", messages=[ChatMessage(role="user", content="hello there")]), "messages")):
        with pytest.raises(RequestError) as err:
            tok(bad)
        assert err.value.param == param and "out of range [0, 1000)" in str(err.value)
