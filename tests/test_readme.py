"""README.md stays short, and the commands it shows stay true.

Every `rill ...` command line in the README's fenced code blocks (and every `scripts/serve.sh ...`
line, whose arguments go to `rill serve`) is checked against the real parser,
`rill.services.cli.build_parser()`, for its subcommand (serve, service, chat, bench serve): each
`--flag` must be one of that subcommand's option strings, spelled out in full (argparse would
accept an abbreviation; the README must not rely on it), and a value given to a flag with
choices must be one of them. The `rill serve` flag table (`| flag | default | meaning |`) is
checked the same way, and must list every flag `rill serve` has. Usage notation is understood:
`[--flag X]`, `--[no-]flag` (both spellings are checked), `a|b` alternatives, `{a,b}` choices,
continuation lines (a trailing backslash, or an indented line of `[...]` / `--...` after a
command), `# comments`.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rill.services.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
MAX_LINES = 300

# A command starts a line (or follows `&&`, `;`, `|`): `rill SUB ...`, `.venv/bin/rill SUB ...`,
# `scripts/serve.sh ...`, optionally after `$ ` and VAR=value assignments.
COMMAND = re.compile(r"^(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?P<prog>(?:\S*/)?rill|(?:\S*/)?scripts/serve\.sh)"
                     r"(?=\s|$)(?P<rest>.*)$")
FLAG = re.compile(r"(?<![\w\-])--(?P<no>\[no-\])?(?P<name>[a-z0-9][a-z0-9-]*)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|^<.*>$|^\.\.\.$")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    top = _subparsers(build_parser())
    return {"serve": top["serve"], "service": top["service"], "chat": top["chat"],
            "bench serve": _subparsers(top["bench"])["serve"]}


def fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a ``` fenced block."""
    out, inside = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if inside:
            out.append((no, line))
    return out


def _strip_comment(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line).rstrip()


def command_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, program, arguments) of every rill / serve.sh command in fenced blocks, with
    its continuation lines joined on."""
    lines = fenced_lines(text)
    found: list[tuple[int, str, str]] = []
    i = 0
    while i < len(lines):
        no, raw = lines[i]
        i += 1
        for segment in re.split(r"&&|\|\||;|\s\|\s", _strip_comment(raw)):  # a|b stays: usage notation
            m = COMMAND.match(segment.strip())
            if not m:
                continue
            rest = m["rest"]
            while i < len(lines) and lines[i][0] == lines[i - 1][0] + 1:
                nxt = _strip_comment(lines[i][1])
                if rest.rstrip().endswith("\\") or (nxt[:1].isspace() and nxt.strip()[:1] in ("[", "-")):
                    rest = rest.rstrip().removesuffix("\\") + " " + nxt.strip()
                    i += 1
                else:
                    break
            found.append((no, m["prog"], rest))
    return found


def _subcommand(prog: str, rest: str) -> tuple[str | None, list[str]]:
    """The subcommand a command line runs and its remaining words."""
    words = rest.split()
    if prog.endswith("serve.sh"):
        return "serve", words
    if words[:2] == ["bench", "serve"]:
        return "bench serve", words[2:]
    if words and words[0] in ("serve", "service", "chat"):
        return words[0], words[1:]
    return None, words


def _value_problems(action: argparse.Action, value: str, flag: str) -> list[str]:
    if action.choices is None or value.startswith("-"):
        return []
    problems = []
    for part in value.strip("[]{}").split("|"):
        if part and not PLACEHOLDER.match(part) and part not in action.choices:
            problems.append(f"{flag} {part!r} is not one of {sorted(map(str, action.choices))}")
    return problems


def flag_problems(parser: argparse.ArgumentParser, args: str, values: bool = True) -> list[str]:
    """What in `args` the parser would not accept as written: unknown or abbreviated flags and
    (with `values`) values outside a flag's choices."""
    problems = []
    words = args.split()
    for k, word in enumerate(words):
        for m in FLAG.finditer(word):
            names = [f"--{m['name']}", f"--no-{m['name']}"] if m["no"] else [f"--{m['name']}"]
            for flag in names:
                action = parser._option_string_actions.get(flag)
                if action is None:
                    problems.append(f"unknown flag {flag}")
                elif values and action.nargs != 0:
                    value = word.split("=", 1)[1] if "=" in word else words[k + 1] if k + 1 < len(words) else ""
                    problems += _value_problems(action, value.rstrip("]"), flag)
    return problems


def _positional_problems(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """`rill service NAME`: a literal name (or each of `{a,b}`) must be one of the choices."""
    choices = next((a.choices for a in parser._actions if not a.option_strings and a.choices), None)
    if choices is None or not words or words[0].startswith(("-", "[")):
        return []
    names = words[0].strip("{}").split(",")
    return [f"{n!r} is not one of {sorted(choices)}" for n in names if not PLACEHOLDER.match(n) and n not in choices]


def readme_problems(text: str) -> tuple[list[str], set[str]]:
    """Every problem of the README's command lines and flag table, and the subcommands it shows."""
    parsers = command_parsers()
    problems, seen = [], set()
    for no, prog, rest in command_lines(text):
        sub, words = _subcommand(prog, rest)
        if sub is None:
            problems.append(f"line {no}: `{prog}{rest}`: no such rill subcommand")
            continue
        seen.add(sub)
        found = _positional_problems(parsers[sub], words) + flag_problems(parsers[sub], " ".join(words))
        problems += [f"line {no}: rill {sub}: {p}" for p in found]
    serve = parsers["serve"]
    for no, flags in flag_table(text):
        problems += [f"line {no}: flag table: {p}" for p in flag_problems(serve, flags, values=False)]
    return problems, seen


def flag_table(text: str) -> list[tuple[int, str]]:
    """(line number, first cell) of every row of the `| flag | default | meaning |` table."""
    rows, inside = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\|\s*flag\s*\|", line):
            inside = True
            continue
        if inside and not line.startswith("|"):
            inside = False
        if inside and not re.match(r"^\|[-\s|]+\|$", line):
            rows.append((no, line.split("|")[1]))
    return rows


def test_readme_is_at_most_300_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; keep it to {MAX_LINES} (details elsewhere)"


def test_readme_commands_use_real_flags() -> None:
    problems, seen = readme_problems(README.read_text(encoding="utf-8"))
    assert not problems, "README.md disagrees with rill's parser:\n" + "\n".join(problems)
    assert seen >= {"serve", "service", "chat", "bench serve"}, f"commands found only for {sorted(seen)}"


def test_readme_flag_table_lists_every_serve_flag() -> None:
    rows = flag_table(README.read_text(encoding="utf-8"))
    assert rows, "README.md has no `| flag | default | meaning |` table"
    listed = set()
    for _, cell in rows:
        for m in FLAG.finditer(cell):
            listed |= {f"--{m['name']}", f"--no-{m['name']}"} if m["no"] else {f"--{m['name']}"}
    serve = command_parsers()["serve"]
    missing = sorted(f for a in serve._actions for f in a.option_strings
                     if f.startswith("--") and f != "--help" and f not in listed)
    assert not missing, f"rill serve flags missing from README.md's flag table: {missing}"


def test_checker_catches_misspelled_flags_and_values() -> None:
    text = "\n".join([
        "```bash",
        "rill serve --max-num-seq 4 --dtype auto   # abbreviated: argparse takes it, the README must not",
        "scripts/serve.sh --prot 8080",
        "rill chat [--temprature 0.7]",
        "rill bench serve --base-url http://x \\",
        "    --[no-]ignore-eos --backend openai-chat|grpc",
        "rill service tokeniser --redis-url URL",
        "rill sevre",
        "```",
        "",
        "| flag | default | meaning |",
        "|---|---|---|",
        "| `--[no-]enable-prefix-cache` | on | misspelled |",
    ])
    problems, _ = readme_problems(text)
    joined = "\n".join(problems)
    for expected in ("--max-num-seq", "--prot", "--temprature", "--no-ignore-eos", "'grpc'", "'tokeniser'",
                     "no such rill subcommand", "--enable-prefix-cache", "--no-enable-prefix-cache"):
        assert expected in joined, f"{expected} not reported in:\n{joined}"
    assert not re.search(r"flag --ignore-eos\b|--dtype|--base-url|'openai-chat' is not", joined), joined


def test_checker_accepts_usage_notation() -> None:
    text = "\n".join([
        "```bash",
        "$ RILL_LOG_LEVEL=DEBUG .venv/bin/rill serve [MODEL] [--port 8000] --[no-]async-scheduling \\",
        "      --quantization none|int8 --dtype=bfloat16",
        "rill service {gateway,worker} [MODEL] --redis-url URL",
        "             [--role both|prefill|decode] [--reuse-port]",
        "cd /srv && rill chat --no-stats | tee log   # a comment with --nonsense",
        "```",
    ])
    problems, seen = readme_problems(text)
    assert not problems, problems
    assert seen == {"serve", "service", "chat"}
