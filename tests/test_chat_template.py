"""Lean tokenizer replicas: the chat template rendered with jinja2 and ids from `tokenizers` equal
transformers' `apply_chat_template` (SmolLM2's template and Llama-3, Qwen2.5 and Gemma-style ones
in tests/chat_templates/, with tools, tool calls and tool results), and a replica imports neither
torch nor transformers. Tools and a tool-call history also go through the real gateway."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from rill.services.gateway.errors import APIError
from rill.services.tokenizer.chat_template import ChatTemplates, TemplateError
from rill.services.tokenizer.service import RequestError, Tokenizer
from rill.services.tokenizer.tool_prompt import calls_in_content, history_as_text, tools_in_system, with_tools
from rill.shared.request_params import ChatMessage, ChatToolCall
from rill.shared.schema import GenerateRequest, TokenizeRequest

TEMPLATES = Path(__file__).parent / "chat_templates"
TEMPLATE_FILES = sorted(TEMPLATES.glob("*.jinja"))

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (<city>, \"quoted\" & unicode: Zürich).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}

# Each case: the messages as Rill carries them (OpenAI form: arguments as JSON text, null content
# as ""), and as transformers' docs write them (arguments as a dict), with the tools offered.
Case = tuple[list[ChatMessage], list[dict[str, Any]], list[dict[str, Any]] | None]
CALL = ChatToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris", "unit": "c"}')
CASES: dict[str, Case] = {
    "one turn": ([ChatMessage(role="user", content="Hello there!")],
                 [{"role": "user", "content": "Hello there!"}], None),
    "multi-turn": ([ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi"),
                    ChatMessage(role="assistant", content="Hello! 😀"), ChatMessage(role="user", content="2+2?")],
                   [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello! 😀"}, {"role": "user", "content": "2+2?"}], None),
    "tools": ([ChatMessage(role="user", content="Weather in Paris?")],
              [{"role": "user", "content": "Weather in Paris?"}], [WEATHER, CLOCK]),
    "tool round trip": (
        [ChatMessage(role="system", content="You help."), ChatMessage(role="user", content="Weather in Paris?"),
         ChatMessage(role="assistant", content="", tool_calls=[CALL]),
         ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1", name="get_weather")],
        [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
         {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"}],
        [WEATHER]),
}


@pytest.fixture(scope="module")
def hf(smollm2_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def tokenizers(smollm2_dir: str) -> dict[str, Tokenizer]:
    """A Tokenizer per template: the model's own, and each file as --chat-template."""
    out = {"model": Tokenizer(smollm2_dir, 2048)}
    out.update({f.name: Tokenizer(smollm2_dir, 2048, chat_template=str(f)) for f in TEMPLATE_FILES})
    return out


def _hf_template(name: str) -> str | None:
    return None if name == "model" else (TEMPLATES / name).read_text()


@pytest.mark.parametrize("template", ["model", *(f.name for f in TEMPLATE_FILES)])
@pytest.mark.parametrize("case", list(CASES))
def test_prompt_and_ids_equal_transformers(hf, tokenizers: dict[str, Tokenizer], template: str, case: str) -> None:
    """Templates that render tools get them as transformers passes them; the others (SmolLM2's,
    Gemma's) would drop them, so they get the messages tool_prompt.py writes, rendered as
    transformers renders those; Phi-4-mini's (the model's own, from its tokenizer_config.json)
    gets them in its system message, as its model card writes them."""
    ours, theirs, tools = CASES[case]
    tok = tokenizers[template]
    in_text = tools is not None and not template.endswith("_tools.jinja")
    if in_text and template == "phi4_mini.jinja":
        theirs, tools_arg = tools_in_system(theirs, tools), None
    elif in_text:
        theirs, tools_arg = with_tools(theirs, tools), None
    else:
        tools_arg = tools
    for gen in (True, False):
        want = hf.apply_chat_template(theirs, tools=tools_arg, chat_template=_hf_template(template),
                                      add_generation_prompt=gen, tokenize=False)
        assert tok.render(ours, gen, tools) == want
    want_ids = hf.apply_chat_template(theirs, tools=tools_arg, chat_template=_hf_template(template),
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.chat_ids(ours, True, tools) == list(want_ids)
    if tools:  # every template now shows the model the tools, and the calls of its history
        prompt = tok.render(ours, True, tools)
        assert "get_weather" in prompt
        assert case != "tool round trip" or '{"temp": 21}' in prompt


@pytest.mark.parametrize("template", ["model", *(f.name for f in TEMPLATE_FILES)])
@pytest.mark.parametrize("begun", ["The weather in Paris is", "Sure: {\"city\": ", "trailing space "])
def test_continue_final_message_equals_transformers(hf, tokenizers: dict[str, Tokenizer], template: str,
                                                    begun: str) -> None:
    """An assistant reply the client began: the prompt ends inside it (no end of turn), as
    transformers cuts it, or the request is refused by name where transformers refuses it."""
    ours = [*CASES["multi-turn"][0], ChatMessage(role="assistant", content=begun)]
    theirs = [*CASES["multi-turn"][1], {"role": "assistant", "content": begun}]
    tok = tokenizers[template]
    try:
        want = hf.apply_chat_template(theirs, chat_template=_hf_template(template), add_generation_prompt=False,
                                      continue_final_message=True, tokenize=False)
    except ValueError:
        with pytest.raises(RequestError) as err:
            tok.render(ours, False, continue_final_message=True)
        assert err.value.param == "continue_final_message"
        return
    got = tok.render(ours, False, continue_final_message=True)
    assert got == want and got.rstrip().endswith(begun.rstrip())
    assert tok.chat_ids(ours, False, continue_final_message=True) == list(hf.apply_chat_template(
        theirs, chat_template=_hf_template(template), add_generation_prompt=False, continue_final_message=True,
        tokenize=True, return_dict=False))


def test_continue_final_message_refused_where_the_template_rewrites_it(hf) -> None:
    """A template that rewrites the final message (or never writes content) leaves nowhere to
    continue it: transformers raises, Rill refuses by name."""
    from rill.services.tokenizer.chat_template import ContinueError

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "It is"}]
    for source in ("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}",
                   "{% for m in messages %}{{ m.role }}{% endfor %}"):
        with pytest.raises(ValueError, match="continue_final_message"):
            hf.apply_chat_template(msgs, chat_template=source, continue_final_message=True, tokenize=False)
        with pytest.raises(ContinueError, match="continue_final_message"):
            ChatTemplates({"default": source}).pick(False).render(msgs, continue_final_message=True)


@pytest.mark.parametrize("template", ["model", *(f.name for f in TEMPLATE_FILES)])
def test_a_developer_message_is_the_system_turn(hf, tokenizers: dict[str, Tokenizer], template: str) -> None:
    """OpenAI's "developer" role replaced "system": a template that does not know the name gets
    the turn as "system" (Gemma's would otherwise refuse it); one that does gets it as is."""
    ours = [ChatMessage(role="developer", content="Be brief."), ChatMessage(role="user", content="Hi")]
    want = hf.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                  chat_template=_hf_template(template), add_generation_prompt=True, tokenize=False)
    assert tokenizers[template].render(ours) == want
    knows = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{# developer #}"
    assert ChatTemplates({"default": knows}).pick(False).render([{"role": "developer", "content": "x"}]) == \
        "developer:x;"


@pytest.mark.parametrize("template", ["model", "gemma.jinja", "phi4_mini.jinja"])
def test_tool_history_without_tools_is_text_where_the_template_renders_none(
        hf, tokenizers: dict[str, Tokenizer], template: str) -> None:
    """A later turn that offers no tools still shows the model its earlier calls and results (as
    with tools), not an empty assistant turn (SmolLM2's, Phi-4-mini's) or a refused "tool" role (Gemma's)."""
    ours, theirs, _ = CASES["tool round trip"]
    ours = [*ours, ChatMessage(role="assistant", content="18 degrees."), ChatMessage(role="user", content="Thanks")]
    theirs = [*theirs, {"role": "assistant", "content": "18 degrees."}, {"role": "user", "content": "Thanks"}]
    as_text = calls_in_content if template == "phi4_mini.jinja" else history_as_text
    got = tokenizers[template].render(ours)
    assert got == hf.apply_chat_template(as_text(theirs), chat_template=_hf_template(template),
                                         add_generation_prompt=True, tokenize=False)
    assert '"name": "get_weather"' in got and '{"temp": 21}' in got


RAG = ("{% for d in documents or [] %}<doc title=\"{{ d.title }}\">{{ d.text }}</doc>\n{% endfor %}"
       "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
       "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_documents_reach_a_template_that_reads_them(hf, smollm2_dir: str, tmp_path: Path) -> None:
    """A request's documents (in its template variables) render as transformers renders them; a
    template that reads none refuses them by name rather than drop them."""
    (tmp_path / "rag.jinja").write_text(RAG)
    docs = [{"title": "Rivers", "text": "The Rhine is 1,230 km long."}, {"title": "Zürich", "text": "A lake."}]
    msgs = [ChatMessage(role="user", content="How long is the Rhine?")]
    got = Tokenizer(smollm2_dir, 2048, chat_template=str(tmp_path / "rag.jinja")).render(
        msgs, kwargs={"documents": docs})
    assert got == hf.apply_chat_template([{"role": "user", "content": "How long is the Rhine?"}], documents=docs,
                                         chat_template=RAG, add_generation_prompt=True, tokenize=False)
    assert '<doc title="Zürich">A lake.</doc>' in got
    with pytest.raises(RequestError) as err:
        Tokenizer(smollm2_dir, 2048).render(msgs, kwargs={"documents": docs})
    assert err.value.param == "documents"


EFFORT = ("{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
          "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}")


def test_reasoning_effort_reaches_a_template_that_reads_it(hf, smollm2_dir: str, tmp_path: Path) -> None:
    """reasoning_effort renders as transformers renders it (gpt-oss's templates read it); a
    template that never reads it refuses it by name."""
    (tmp_path / "effort.jinja").write_text(EFFORT)
    msgs = [ChatMessage(role="user", content="Why is the sky blue?")]
    got = Tokenizer(smollm2_dir, 2048, chat_template=str(tmp_path / "effort.jinja")).render(
        msgs, kwargs={"reasoning_effort": "low"})
    assert got == hf.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}], reasoning_effort="low",
                                         chat_template=EFFORT, tokenize=False)
    assert got.startswith("Reasoning: low\n")
    with pytest.raises(RequestError) as err:
        Tokenizer(smollm2_dir, 2048).render(msgs, kwargs={"reasoning_effort": "low"})
    assert err.value.param == "reasoning_effort"


def test_a_request_brings_its_own_template_where_trusted(hf, smollm2_dir: str) -> None:
    """vLLM's chat_template field (or chat_template_kwargs' chat_template, as transformers reads it):
    rendered as transformers renders it, reading the request's variables, on a tokenizer started
    with --trust-request-chat-template; elsewhere, or when it does not parse, a 400 naming it."""
    msgs = [ChatMessage(role="user", content="Why is the sky blue?")]
    hf_msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    trusted = Tokenizer(smollm2_dir, 2048, trust_request_chat_template=True)
    got = trusted.render(msgs, kwargs={"chat_template": EFFORT, "reasoning_effort": "high"})
    assert got == hf.apply_chat_template(hf_msgs, chat_template=EFFORT, reasoning_effort="high", tokenize=False)
    assert trusted.render(msgs) == hf.apply_chat_template(hf_msgs, add_generation_prompt=True, tokenize=False)
    ids = trusted.chat_ids(msgs, kwargs={"chat_template": EFFORT})
    assert ids == hf.apply_chat_template(hf_msgs, chat_template=EFFORT, tokenize=True, return_dict=True)["input_ids"]
    for tok, template in ((Tokenizer(smollm2_dir, 2048), EFFORT), (trusted, "{% for m in messages %}"),
                          (trusted, "{{ raise_exception('no') }}"), (trusted, "{{ ''.__class__.__mro__ }}")):
        with pytest.raises(RequestError) as err:
            tok.render(msgs, kwargs={"chat_template": template})
        assert err.value.param == "chat_template"


def test_tools_in_text_for_templates_without_them(smollm2_dir: str, tmp_path: Path) -> None:
    """A template that never reads `tools`: the signatures in the system turn (or the first user
    turn when it refuses a system one), calls and results as hermes blocks; one that reads
    them is left alone."""
    calls = [ChatToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}'),
             ChatToolCall(id="c2", name="now", arguments="{}")]
    hist = [ChatMessage(role="user", content="Weather?"),
            ChatMessage(role="assistant", content="Looking.", tool_calls=calls),
            ChatMessage(role="tool", content="21C", tool_call_id="c1"),
            ChatMessage(role="tool", content="noon", tool_call_id="c2")]
    plain = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    no_system = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not "
                 "supported') }}{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    reads = "{% if tools %}T{{ tools | length }}{% endif %}{% for m in messages %}[{{ m.role }}]{% endfor %}"
    out = {}
    for name, src in (("plain", plain), ("no_system", no_system), ("reads", reads)):
        (tmp_path / f"{name}.jinja").write_text(src)
        out[name] = Tokenizer(smollm2_dir, 256, chat_template=str(tmp_path / f"{name}.jinja")).render(
            hist, True, [WEATHER, CLOCK])
    sig = json.dumps(WEATHER, ensure_ascii=False)
    assert out["plain"].startswith("[system]# Tools") and sig in out["plain"]
    turns = re.split(r"\[(?:system|user|assistant|tool)\]", out["plain"])[2:]
    assert turns[0] == "Weather?"
    assert turns[1].startswith("Looking.\n<tool_call>\n")
    assert [json.loads(b.split("\n</tool_call>")[0]) for b in turns[1].split("<tool_call>\n")[1:]] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]
    assert out["plain"].count("[user]") == 2 and turns[2] == "<tool_response>\n21C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    assert out["no_system"].startswith("[user]# Tools") and out["no_system"].count(sig) == 1
    assert out["no_system"].split("</tools>")[1].split("[assistant]")[0].endswith("Weather?")
    assert out["reads"] == "T2[user][assistant][tool][tool]"
    plain_tok = Tokenizer(smollm2_dir, 256, chat_template=str(tmp_path / "plain.jinja"))
    assert plain_tok.render(hist[:1], True, []) == plain_tok.render(hist[:1]) == "[user]Weather?"  # no tools offered


def test_phi4_mini_takes_tools_in_its_system_message(tokenizers: dict[str, Tokenizer]) -> None:
    """The prompt Phi-4-mini's model card shows: the functions' JSON list between <|tool|> tags
    in the system turn (the card's system text when the request has none); earlier calls as
    <|tool_call|> JSON; and the gateway reads its calls with the phi4_mini parser."""
    from rill.services.gateway.tool_formats import pick_parser, template_sources

    tok = tokenizers["phi4_mini.jinja"]
    functions = json.dumps([WEATHER["function"]], ensure_ascii=False)
    prompt = tok.render([ChatMessage(role="user", content="Weather in Paris?")], True, [WEATHER])
    assert prompt == ("<|system|>You are a helpful assistant with some tools.<|tool|>" + functions
                      + "<|/tool|><|end|><|user|>Weather in Paris?<|end|><|assistant|>")
    ours = CASES["tool round trip"][0]
    prompt = tok.render(ours, True, [WEATHER])
    assert prompt.startswith("<|system|>You help.<|tool|>" + functions + "<|/tool|><|end|>")
    assert '<|assistant|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]' \
        '<|/tool_call|><|end|><|tool|>{"temp": 21}<|end|>' in prompt
    assert tok.render(ours[:2], True) == "<|system|>You help.<|end|><|user|>Weather in Paris?<|end|><|assistant|>"
    assert pick_parser("auto", template_sources(".", TEMPLATES / "phi4_mini.jinja")).name == "phi4_mini"


def test_text_prompts_eos_and_decode_equal_transformers(hf, tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["model"]
    for text in ("Hello world", "  leading spaces and <|im_start|> a special token", "日本語 😀 café\n\tx"):
        for special in (True, False):
            assert tok.tok.encode(text, special) == hf(text, add_special_tokens=special)["input_ids"]
        ids = hf(text)["input_ids"]
        assert tok.tok.decode(ids) == hf.decode(ids)
    assert tok.tok.special_tokens == hf.special_tokens_map
    assert hf.eos_token_id in tok.eos_token_ids


def test_gemma3_sentencepiece_tokenizer_equals_transformers(gemma3_dir: str) -> None:
    """A second tokenizer kind (Gemma 3: SentencePiece-style, BOS added by the post-processor,
    not byte-level, so the detokenizer decodes text windows)."""
    from transformers import AutoTokenizer

    from rill.services.detokenizer.incremental import Detokenizer
    from rill.shared.tokenizer_files import load_tokenizer

    hf, tok = AutoTokenizer.from_pretrained(gemma3_dir), load_tokenizer(gemma3_dir)
    assert tok.special_tokens == hf.special_tokens_map and hf.eos_token_id in tok.eos_token_ids
    detok = Detokenizer(tok.tokenizer)  # what load_detokenizer builds
    assert not detok.byte_level
    for text in ("Hello world", "  leading <start_of_turn> x", "日本語 😀 café\n\tx"):
        for special in (True, False):
            assert tok.encode(text, special) == hf(text, add_special_tokens=special)["input_ids"]
        ids = tok.encode(text, False)
        assert tok.decode(ids) == hf.decode(ids)
        rows = [detok.detokenize_row(ids[:i], ids[i:i + 1], i, final=i == len(ids) - 1) for i in range(len(ids))]
        assert "".join(r.text for r in rows) == hf.decode(ids, skip_special_tokens=True)


def test_add_special_tokens_follows_the_request(gemma3_dir: str) -> None:
    """Gemma 3's tokenizer adds BOS: a text prompt gets it unless add_special_tokens is false; a
    chat template writes its own, and gets a second only when asked (as vLLM)."""
    from rill.shared.request_params import SamplingParams

    tok = Tokenizer(gemma3_dir, 2048, chat_template=str(TEMPLATES / "gemma.jinja"))
    bos, hi = tok.tok.encode("<bos>", add_special_tokens=False), tok.tok.encode("Hi", add_special_tokens=False)

    def ids(kind: str, add: bool | None) -> list[int]:
        chat = {"messages": [ChatMessage(role="user", content="Hi")]} if kind == "chat" else {"prompt": "Hi"}
        return tok.prompt_ids(GenerateRequest(request_id="r", reply_to="x", kind=kind, params=SamplingParams(),
                                              arrival_time=0.0, add_special_tokens=add, **chat))

    assert ids("completion", None) == ids("completion", True) == bos + hi and ids("completion", False) == hi
    templated = ids("chat", None)
    assert templated[:1] == bos and templated[1:2] != bos and ids("chat", False) == templated
    assert ids("chat", True) == bos + templated
    msgs = [ChatMessage(role="user", content="Hi")]  # /tokenize follows the same defaults
    assert tok.tokenize(TokenizeRequest("r", "x", messages=msgs)).token_ids == templated
    assert tok.tokenize(TokenizeRequest("r", "x", messages=msgs, add_special_tokens=True)).token_ids == bos + templated
    assert tok.tokenize(TokenizeRequest("r", "x", prompt="Hi")).token_ids == bos + hi


def test_lean_detokenizer_decodes_as_with_transformers(hf, smollm2_dir: str) -> None:
    """The detokenizer replica's tables (tokenizers alone) equal those built from transformers'
    tokenizer, which tests/test_detokenizer.py checks byte for byte against its decode."""
    from rill.services.detokenizer.incremental import Detokenizer
    from rill.services.detokenizer.service import load_detokenizer

    lean = load_detokenizer(smollm2_dir)
    assert lean.byte_level and lean._tables == Detokenizer(hf)._tables
    assert [lean.token_str(i) for i in range(0, 49152, 97)] == [hf.decode([i]) for i in range(0, 49152, 97)]


def test_template_errors_and_kwargs(hf, tokenizers: dict[str, Tokenizer]) -> None:
    gemma, llama = tokenizers["gemma.jinja"], tokenizers["llama3_tools.jinja"]
    two_users = [ChatMessage(role="user", content="a"), ChatMessage(role="user", content="b")]
    with pytest.raises(RequestError, match="roles must alternate") as err:  # the template's raise_exception
        gemma.render(two_users)
    assert err.value.param == "messages"
    # chat_template_kwargs reach the template (the date Llama-3 templates take), unused ones are
    # dropped as vLLM drops them, and names the renderer owns are refused.
    msgs = [ChatMessage(role="user", content="Hi")]
    got = llama.render(msgs, kwargs={"date_string": "26 Jul 2024", "not_in_template": 1})
    assert "Today Date: 26 Jul 2024" in got
    assert got == hf.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         chat_template=_hf_template("llama3_tools.jinja"), tokenize=False,
                                         date_string="26 Jul 2024")
    assert time.strftime("%d %b %Y") in llama.render(msgs)  # strftime_now by default
    for bad in ({"messages": []}, {"tokenize": True}):
        with pytest.raises(RequestError, match="may not set") as err:
            llama.render(msgs, kwargs=bad)
        assert err.value.param == "chat_template_kwargs"
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplates({"default": "{% for m in messages %}"})
    # Malformed arguments in the history do not fail the turn (vLLM passes {} too).
    bad_call = ChatToolCall(id="c", name="get_weather", arguments="{not json")
    hist = [ChatMessage(role="user", content="x"), ChatMessage(role="assistant", content="", tool_calls=[bad_call])]
    assert '"arguments": {}' in tokenizers["qwen_tools.jinja"].render(hist, True, [WEATHER])


def test_named_templates_pick_tool_use_for_tools(smollm2_dir: str, tmp_path: Path) -> None:
    """A model with several templates (tokenizer_config.json's list): "tool_use" when the request
    has tools, else "default", as transformers picks."""
    for f in Path(smollm2_dir).iterdir():
        if f.suffix != ".safetensors" and f.name != "chat_template.jinja":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "plain:{{ messages[0].content }}"},
                            {"name": "tool_use", "template": "tools:{{ tools | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(str(tmp_path), 256)
    msgs = [ChatMessage(role="user", content="hi")]
    assert tok.render(msgs) == "plain:hi"
    assert tok.render(msgs, tools=[WEATHER, CLOCK]) == "tools:2"


def test_replicas_import_no_torch_or_transformers(smollm2_dir: str) -> None:
    code = ("import sys\n"
            "from rill.services.tokenizer.service import Tokenizer\n"
            "from rill.services.detokenizer.service import load_detokenizer\n"
            "from rill.services.cli import build_parser, engine_args\n"
            f"engine_args(build_parser().parse_args(['service', 'tokenizer', {smollm2_dir!r}]), {smollm2_dir!r})\n"
            f"t = Tokenizer({smollm2_dir!r}, 2048)\n"
            f"d = load_detokenizer({smollm2_dir!r})\n"
            "from rill.shared.request_params import ChatMessage\n"
            "assert t.chat_ids([ChatMessage(role='user', content='hi')]) and d.byte_level\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# Through the gateway (HTTP body -> GenerateRequest / TokenizeRequest -> tokenizer replica)


def test_chat_body_reaches_the_template(tokenizers: dict[str, Tokenizer]) -> None:
    """A chat body with tools, a tool call (null content) and a tool result, parsed by the gateway,
    tokenizes as transformers renders the same conversation."""
    from rill.services.gateway import requests
    from rill.services.gateway.bodies import ChatCompletionRequest

    body = {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
        "tools": [WEATHER], "chat_template_kwargs": {"unused": True}}
    gate = requests.Admission(model_name="m")
    req = requests.generate_requests(requests.parse(json.dumps(body), ChatCompletionRequest, gate), "r", "x")[0]
    assert isinstance(req, GenerateRequest) and req.tools == [WEATHER]
    tok = tokenizers["qwen_tools.jinja"]
    got = tok(req).prompt_token_ids
    # Text parts joined with a newline, null content as "" (vLLM's rules).
    expected = [ChatMessage(role="user", content="Weather\nin Paris?"),
                ChatMessage(role="assistant", content="", tool_calls=[CALL]),
                ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1")]
    assert got == tok.chat_ids(expected, True, [WEATHER])
    for bad, param in (([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
                       ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "f"}}]}],
                        "messages[0].tool_calls[0].function.arguments")):
        with pytest.raises(APIError) as err:
            requests.parse(json.dumps({"messages": bad}), ChatCompletionRequest, gate)
        assert err.value.param == param
    with pytest.raises(APIError) as err:
        requests.parse(json.dumps({"messages": [{"role": "user", "content": "x"}],
                                   "tools": [{"type": "custom", "custom": {"name": "x"}}]}),
                       ChatCompletionRequest, gate)
    assert err.value.param == "tools[0].type"


@pytest.fixture
def stack(redis_url: str, smollm2_dir: str) -> Iterator[str]:
    """A real gateway (uvicorn, in a thread) and a tokenizer replica with the Qwen-style template
    as --chat-template, on a fresh prefix: the gateway's URL."""
    import socket

    import uvicorn

    from rill.services.gateway.app import create_app
    from rill.services.tokenizer import service as tokenizer_service
    from rill.shared.lifecycle import StopFlag

    prefix = f"test-tmpl-{uuid.uuid4().hex[:10]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(redis_url, prefix, "m", 2048)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    stop = StopFlag(install=False)
    threads = [threading.Thread(target=server.run, daemon=True),
               threading.Thread(target=tokenizer_service.run, daemon=True,
                                args=(redis_url, prefix, smollm2_dir, 2048, "tok-test"),
                                kwargs={"stop": stop, "chat_template": str(TEMPLATES / "qwen_tools.jinja")})]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        stop.set()
        for t in threads:
            t.join(10)
        r = redis.Redis.from_url(redis_url)
        keys = list(r.scan_iter(match=f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()


def test_tokenize_endpoint_renders_tools_and_tool_history(stack: str, hf) -> None:
    ours, theirs, tools = CASES["tool round trip"]
    openai_messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "call_1", "type": "function", "function": {
                               "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                       {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'}]
    template = (TEMPLATES / "qwen_tools.jinja").read_text()
    with httpx.Client(base_url=stack, timeout=30) as c:
        r = c.post("/v1/tokenize", json={"messages": openai_messages[:2], "tools": tools})
        assert r.status_code == 200, r.text
        prompt = hf.decode(r.json()["tokens"])
        assert json.dumps(WEATHER, ensure_ascii=False) in prompt  # the template received the tools
        assert r.json()["tokens"] == hf.apply_chat_template(theirs[:2], tools=tools, chat_template=template,
                                                            add_generation_prompt=True, return_dict=False)
        r = c.post("/v1/tokenize", json={"messages": openai_messages, "tools": tools})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == hf.apply_chat_template(theirs, tools=tools, chat_template=template,
                                                            add_generation_prompt=True, return_dict=False)
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in \
            hf.decode(r.json()["tokens"])
        r = c.post("/v1/tokenize", json={"messages": openai_messages[:2], "chat_template_kwargs": {"tokenize": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
        # A reply the client began: continued (add_generation_prompt left out means false then).
        begun = [*openai_messages[:2], {"role": "assistant", "content": "It is"}]
        r = c.post("/v1/tokenize", json={"messages": begun, "continue_final_message": True})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == hf.apply_chat_template(begun, chat_template=template, continue_final_message=True,
                                                            return_dict=False)
        for bad in ({"messages": begun, "continue_final_message": True, "add_generation_prompt": True},
                    {"prompt": "x", "continue_final_message": False}):
            r = c.post("/v1/tokenize", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_bench_replicas_reports_lean_replicas(redis_url: str, tmp_path: Path) -> None:
    """scripts/bench_replicas.py starts each kind as `rill service KIND`: tokenizer and
    detokenizer replicas without torch, well under the issue's bounds (~150 MB, 2 s; asserted
    loosely, the CPU is shared)."""
    out = tmp_path / "rows.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_replicas.py"
    run = subprocess.run([sys.executable, str(script), "--repeat", "1", "--no-reference", "--redis-url", redis_url,
                          "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CPU: " in run.stdout and "tokenizer" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    for kind in ("tokenizer", "detokenizer", "gateway"):
        assert not rows[kind]["torch"], kind
        assert rows[kind]["peak_mib"] < 200 and rows[kind]["ready_s"] < 6, (kind, rows[kind])


def test_chat_template_flag_reaches_the_tokenizers_only(tmp_path: Path) -> None:
    from rill.services.cli import build_parser
    from rill.services.launcher import _child_argv

    template = TEMPLATES / "qwen_tools.jinja"
    for argv in (["serve", "--chat-template", str(template)],
                 ["service", "tokenizer", "--chat-template", str(template)]):
        assert build_parser().parse_args(argv).chat_template == str(template.resolve())
    ns = build_parser().parse_args(["serve", "--chat-template", str(template)])
    child = _child_argv(ns, "tokenizer", "/m", "t")
    assert child[child.index("--chat-template") + 1] == str(template.resolve())
    assert "--chat-template" not in _child_argv(ns, "worker", "/m", "w")
    assert "--chat-template" not in _child_argv(build_parser().parse_args(["serve"]), "tokenizer", "/m", "t")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if messages %}")
    for path in (bad, tmp_path / "missing.jinja"):  # refused before any process starts
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--chat-template", str(path)])
