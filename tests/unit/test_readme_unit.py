"""The README shows only what exists. Every command in it parses with the real parser
(`rayguide ...` with the CLI's, `python -m bench.x` / `bench/x.py` / the batch job with
their own, `make X` is a Makefile target, `serve run` names an importable app builder and
arguments AppSettings accepts, `kubectl -f` files exist); every configuration block and
inline config snippet builds a ClusterConfig; every backticked key name is a field of a
config model, the app settings, a request or the `guided` report (or one of OpenAI's own
names listed below); every HTTP route is one the app serves; every request body (curl,
`extra_body`, the batch line) is accepted by the request models; every link into docs/
reaches a file and a heading. A key renamed in the README, or in the code, fails here.

The README also stays a user guide (at most about 350 lines), and its test command is
what CI runs."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

pytestmark = pytest.mark.unit


def _root() -> Path:
    """The repository root (the folder with the Makefile), wherever this file lives."""
    here = Path(__file__).resolve().parent
    for folder in (here, *here.parents):
        if (folder / "Makefile").is_file() and (folder / "README.md").is_file():
            return folder
    raise AssertionError("no repository root above " + str(here))


ROOT = _root()
README = ROOT / "README.md"
MAX_LINES = 350

# OpenAI's own names (response fields, response_format types): not rayguide's to define
OPENAI_NAMES = {
    "finish_reason", "tool_calls", "reasoning_content", "prompt_tokens_details",
    "cached_tokens", "model_extra", "response_format", "json_schema", "json_object",
    "regex_schema", "tool_choice", "max_tokens", "include_usage", "stream_options",
    "extra_body", "function_call", "function_call_output", "output_parsed",
}
# batch output lines (deploy/batch_job.py writes them; not a model's fields)
BATCH_OUTPUT = {"finish_reason", "error_kind"}
# what a command may start with but this test does not check beyond its name
UNCHECKED_COMMANDS = {"export", "git", "docker", "pip"}


# ---- reading the README ------------------------------------------------------------------

def _text() -> str:
    return README.read_text()


def _blocks(text: str, lang: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"```" + lang + r"\n(.*?)```", text, re.DOTALL)]


def _spans(text: str) -> list[str]:
    """Backticked inline spans outside code blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return re.findall(r"`([^`\n]+)`", prose)


def _commands(block: str) -> list[list[str]]:
    """The shell commands of a bash block as token lists: lines joined across a trailing
    backslash and across quotes left open (a curl body over several lines), comments
    dropped, split at ``;``, ``&&`` and ``|``."""
    out, buf = [], ""
    for line in block.splitlines():
        buf = f"{buf}\n{line}" if buf else line
        if buf.rstrip().endswith("\\"):
            buf = buf.rstrip()[:-1]
            continue
        try:
            tokens = shlex.split(buf, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        buf = ""
        cmd: list[str] = []
        for tok in tokens + [";"]:
            if tok in (";", "&&", "|") or tok.endswith(";"):
                if tok.endswith(";") and tok != ";":
                    cmd.append(tok[:-1])
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(tok)
    assert not buf, f"unfinished command in the README: {buf!r}"
    return out


# ---- parsers, caught before they run anything ----------------------------------------------

class _Parsed(Exception):
    def __init__(self, parser, namespace):
        self.parser, self.namespace = parser, namespace


def _parse(monkeypatch, call) -> _Parsed:
    """Run ``call`` (a main function) until its first ``parse_args``, which parses for real
    and then stops it: nothing past the argument parsing runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(self, original(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        try:
            call()
        except _Parsed as parsed:
            return parsed
        except SystemExit as exc:
            raise AssertionError(f"the arguments do not parse (exit {exc.code})") from None
    raise AssertionError("no argument parser ran")


def _rayguide_parser(monkeypatch) -> argparse.ArgumentParser:
    from cli.main import main

    return _parse(monkeypatch, lambda: main(["status"])).parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert name in action.choices, f"`rayguide {name}`: no such subcommand"
    return action.choices[name]


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def _module_main(module: str, argv: list[str], monkeypatch) -> _Parsed:
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    mod = importlib.import_module(module)
    main = getattr(mod, "main")
    monkeypatch.setattr(sys, "argv", [module, *argv])
    takes_argv = bool(inspect.signature(main).parameters)
    return _parse(monkeypatch, (lambda: main(argv)) if takes_argv else main)


def _make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+(?: [A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


def _route_exists(method: str, path: str) -> bool:
    """Whether the app serves ``method path`` (a ``{param}`` of a route matches any one
    path segment, so ``/v1/sessions/{id}`` and ``/v1/sessions/s1`` both reach
    ``/v1/sessions/{session_id}``)."""
    from deploy.serve_app import fastapi_app

    def walk(routes):  # Serve's ingress keeps the app's routes in an included router
        for route in routes:
            if hasattr(route, "original_router"):
                yield from walk(route.original_router.routes)
            else:
                yield route

    path = path.split("?")[0]
    for route in walk(fastapi_app.routes):
        pattern = re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(route.path))
        if method in (getattr(route, "methods", None) or ()) and re.fullmatch(pattern, path):
            return True
    return False


# ---- checking one command --------------------------------------------------------------------

def _strip_usage(tokens: list[str]) -> tuple[list[str], bool]:
    """``[--host H]`` usage syntax: the brackets dropped; True when there were any (then
    only the option names are checked, their values are placeholders)."""
    usage = any("[" in t or "]" in t or t == "..." for t in tokens)
    return [t.strip("[]") for t in tokens if t.strip("[]") and t != "..."], usage


def _check_options(parser: argparse.ArgumentParser, tokens: list[str], where: str) -> None:
    known = _options(parser)
    for tok in tokens:
        if tok.startswith("--"):
            assert tok.split("=")[0] in known, f"{where}: no option {tok}"


def check_command(tokens: list[str], monkeypatch) -> None:
    where = " ".join(tokens)
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
        tokens = tokens[1:]  # VAR=value before a command
    if not tokens:
        return
    tokens, usage = _strip_usage(tokens)
    head, args = tokens[0], tokens[1:]
    name = head.rsplit("/", 1)[-1]
    if name in ("rayguide", "$rg"):
        parser = _rayguide_parser(monkeypatch)
        if usage:
            _check_options(_subparser(parser, args[0]), args[1:], where)
        else:
            from cli.main import main

            parsed = _parse(monkeypatch, lambda: main(args))
            assert parsed.namespace.command == args[0]
    elif name == "make":
        targets = _make_targets()
        for arg in args:
            if "=" not in arg:
                assert arg in targets, f"{where}: no Makefile target {arg}"
    elif name in ("python", "python3"):
        if args[0] == "-m":
            module, argv = args[1], args[2:]
        else:
            path = ROOT / args[0]
            if not path.is_file():  # a script the README writes out: its block runs in Ray
                _check_readme_script(args[0], where)
                return
            module, argv = ".".join(Path(args[0]).with_suffix("").parts), args[1:]
        assert not usage, f"{where}: write a python command as it is run, no [options]"
        _module_main(module, argv, monkeypatch)
    elif name == "ray":
        if args[:2] == ["job", "submit"]:
            assert "--" in args, f"{where}: ray job submit needs `-- command`"
            check_command(args[args.index("--") + 1:], monkeypatch)
        else:
            assert args[0] in ("start", "stop", "status"), f"{where}: an unknown ray command"
    elif name == "serve":
        assert args[0] in ("run", "deploy"), where
        target = args[1]
        if target.endswith((".yaml", ".yml")):
            assert (ROOT / target).is_file(), f"{where}: no file {target}"
        else:
            module, attr = target.split(":")
            assert callable(getattr(importlib.import_module(module), attr)), where
            from deploy.settings import AppSettings

            AppSettings.from_args(dict(a.split("=", 1) for a in args[2:]))
    elif name == "kubectl":
        for i, arg in enumerate(args):
            if arg == "-f":
                assert (ROOT / args[i + 1]).is_file(), f"{where}: no file {args[i + 1]}"
    elif name == "curl":
        url = next(a for a in args if a.startswith(("http://", "https://", "$")))
        if url.startswith("$"):  # a shell variable the README sets: U=http://...
            m = re.search(r"\b" + re.escape(url[1:]) + r"=(\S+?);?(?:\s|$)", _text())
            assert m, f"{where}: {url} is set nowhere in the README"
            url = m.group(1)
        path = urlparse(url).path
        method = args[args.index("-X") + 1] if "-X" in args else ("POST" if "-d" in args
                                                                  else "GET")
        assert _route_exists(method, path), f"{where}: no route {method} {path}"
        if "-d" in args:
            from deploy import openai_api as api

            body = json.loads(args[args.index("-d") + 1])  # any route's body is JSON
            model = {"/v1/chat/completions": api.ChatCompletionRequest,
                     "/v1/completions": api.CompletionRequest}.get(path)
            if model is not None:  # unknown fields are 400s naming them
                api.parse_request(model, body)
    else:
        assert name in UNCHECKED_COMMANDS, f"the README shows an unknown command: {where}"


def _check_readme_script(name: str, where: str) -> None:
    """``python NAME`` for a file the README writes out (a Python block whose first line is
    ``# NAME``): the block parses, and every name it imports from this repository exists."""
    blocks = [b for b in _blocks(_text(), "python") if b.lstrip().startswith(f"# {name}\n")]
    assert blocks, f"{where}: no file {name}, and no README block `# {name}` that writes it"
    for node in ast.walk(ast.parse(blocks[0])):
        if isinstance(node, ast.ImportFrom) and node.module and (
                ROOT / node.module.split(".")[0]).is_dir():
            mod = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(mod, alias.name), f"{name}: no {node.module}.{alias.name}"


def _all_commands(text: str) -> list[list[str]]:
    cmds = [c for block in _blocks(text, "bash") for c in _commands(block)]
    for span in _spans(text):
        if re.match(r"^(?:\.venv/bin/)?(?:rayguide|make|python -m|curl) ", span):
            cmds.extend(_commands(span))
    return cmds


# ---- names -------------------------------------------------------------------------------

def _fields(model) -> set[str]:
    """A pydantic model's field names, with those of the models nested in it."""
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        ann = info.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            names |= _fields(ann)
    return names


def _known_names() -> set[str]:
    from cluster.config import ClusterConfig
    from deploy import openai_api as api
    from deploy.responses import guided_report
    from deploy.responses_api import ResponsesRequest
    from deploy.settings import AppSettings
    from core.errors import ErrorKind
    from deploy.batch_account import OUTCOMES
    from deploy.batch_input import SAMPLING_PARAMS, SAMPLING_PARAMS_KEYS
    from deploy.batch_output import COLUMNS, GUIDED_FIELDS
    from deploy.data import ProcessorConfig

    class _Out:
        pass

    return (_fields(ClusterConfig) | _fields(AppSettings) | set(api.ChatCompletionRequest
            .model_fields) | set(api.CompletionRequest.model_fields)
            | set(api.GrammarCheckRequest.model_fields) | set(ResponsesRequest.model_fields)
            | set(guided_report(_Out()))
            | {k.value for k in ErrorKind} | OPENAI_NAMES | BATCH_OUTPUT | set(OUTCOMES)
            # the Ray Data processor's rows, columns and config (deploy/data.py)
            | {SAMPLING_PARAMS} | SAMPLING_PARAMS_KEYS | set(COLUMNS) | set(GUIDED_FIELDS)
            | set(ProcessorConfig.model_fields) | {"structural_tag"})


def _config_path(dotted: str) -> bool:
    """``engine.max_num_seqs``: a key of a ClusterConfig section."""
    from cluster.config import ClusterConfig

    model = ClusterConfig
    for part in dotted.split("."):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return False
        model = fields[part].annotation
    return True


SNAKE = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
SECTIONS = ("engine", "grammar_cache", "scheduler", "worker", "serve")


# ---- the tests -------------------------------------------------------------------------------

def test_readme_is_a_guide_of_at_most_350_lines():
    lines = _text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines: move reference to docs/"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.MULTILINE), ".ci/run no longer runs `make test`"
    assert "test" in _make_targets()
    text = _text()
    assert "make test    # install everything, then run the test suite (what CI runs)" in text
    assert "`make test` runs everything except `slow` tests, as CI does (`.ci/run`)" in text


def test_every_command_parses(monkeypatch):
    cmds = _all_commands(_text())
    assert len(cmds) >= 20, cmds
    seen = set()
    for cmd in cmds:
        try:
            check_command(cmd, monkeypatch)
        except Exception as exc:  # name the command: pytest's own message would not
            raise AssertionError(f"README command {' '.join(cmd)!r}: {exc}") from None
        seen.add(cmd[0].rsplit("/", 1)[-1])
    # each kind is reached (a README rewrite that drops one would pass unchecked)
    assert {"rayguide", "make", "python", "ray", "serve", "kubectl", "curl"} <= seen, seen


def test_every_inline_option_exists(monkeypatch):
    """``--allow-open``, ``--retry-errors`` ... in prose: an option of some rayguide
    subcommand or of the batch job."""
    from bench.report import parser as bench_parser
    from deploy import batch_job

    parser = _rayguide_parser(monkeypatch)
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    known = set().union(*(_options(p) for p in action.choices.values()))
    known |= _options(_parse(monkeypatch, lambda: batch_job.parse_args(
        ["--input", "i", "--output", "o"])).parser)
    known |= _options(bench_parser("every bench"))  # --quick, --smoke, --json
    flags = [s.split()[0] for s in _spans(_text()) if re.match(r"^--[a-z]", s)]
    assert len(flags) >= 10, flags
    missing = [f for f in flags if f.split("=")[0] not in known]
    assert not missing, f"README names options no parser has: {missing}"


def test_every_config_block_builds():
    from cluster.config import ClusterConfig

    blocks = _blocks(_text(), "yaml")
    assert len(blocks) >= 2
    for block in blocks:
        ClusterConfig(**yaml.safe_load(block))  # unknown keys and bad values raise


def test_every_inline_config_snippet_builds():
    """``worker: {num_gpus: 1}`` in prose builds a ClusterConfig."""
    from cluster.config import ClusterConfig

    checked = 0
    for span in _spans(_text()):
        if not re.match(r"^(?:" + "|".join(SECTIONS) + r"): \{", span):
            continue
        ClusterConfig(**yaml.safe_load(span))
        checked += 1
    assert checked >= 1


def test_every_key_name_exists():
    known = _known_names()
    unknown = []
    for span in _spans(_text()):
        if SNAKE.match(span) and span not in known:
            unknown.append(span)
        elif "." in span and span.split(".")[0] in SECTIONS and " " not in span:
            if not _config_path(span):
                unknown.append(span)
        elif span.startswith("guided.") and span.split(".", 1)[1] not in known:
            unknown.append(span)
    assert not unknown, f"README names keys nothing defines: {unknown}"


def test_python_examples_send_known_fields():
    """``extra_body={...}`` and the request's keyword arguments in the Python examples are
    fields of the chat request model (``client.responses.*``: of the Responses one)."""
    from deploy import openai_api as api
    from deploy.responses_api import ResponsesRequest

    chat_fields = set(api.ChatCompletionRequest.model_fields)
    client_args = {"extra_body", "model", "messages", "text_format"}
    checked = 0
    for block in _blocks(_text(), "python"):
        for node in ast.walk(ast.parse(block)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("create", "parse", "stream")):
                continue
            owner = node.func.value
            fields = (set(ResponsesRequest.model_fields)
                      if isinstance(owner, ast.Attribute) and owner.attr == "responses"
                      else chat_fields)
            for kw in node.keywords:
                assert kw.arg in fields | client_args, f"unknown request field {kw.arg}"
                if kw.arg == "extra_body" and isinstance(kw.value, ast.Dict):
                    for key in kw.value.keys:
                        assert key.value in fields, f"unknown request field {key.value}"
                        checked += 1
    assert checked >= 5


def test_every_route_exists():
    shown = [s for s in _spans(_text()) if re.match(r"^(GET|POST|PUT|PATCH|DELETE) /", s)]
    assert len(shown) >= 6, shown
    missing = [s for s in shown if not _route_exists(*s.split()[:2])]
    assert not missing, f"README shows routes the app does not serve: {missing}"


def test_batch_line_example_is_accepted():
    from deploy import batch_job

    (block,) = _blocks(_text(), "json")
    for n, line in enumerate(block.splitlines(), 1):
        item = batch_job.parse_line(line, n, defaults={}, default_grammar=None, run_tag="t")
        assert item.error is None, item.error


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_every_docs_link_reaches_a_heading():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", _text())
    assert len(links) >= 10
    for path, anchor in links:
        doc = ROOT / path
        assert doc.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", doc.read_text(), re.MULTILINE)}
            assert anchor in slugs, f"README links to {path}#{anchor}: no such heading"


# ---- the checks themselves catch a rename ------------------------------------------------------

def test_checks_catch_renamed_names(monkeypatch):
    """A renamed key, option, target or route fails (the checks are not vacuous)."""
    from cluster.config import ClusterConfig

    with pytest.raises(ValueError, match="session_idle_timeout"):
        ClusterConfig(**yaml.safe_load("scheduler: {session_idle_timeout: 600}"))
    assert "compile_memory_mb" in _known_names()
    assert "compile_memory_megabytes" not in _known_names()
    assert _config_path("grammar_cache.max_repetition")
    assert not _config_path("grammar_cache.max_repetitions")
    for bad in (["rayguide", "serve", "--listen-on", "x"], ["make", "tests"],
                ["python", "-m", "bench.conformance", "--quik"],
                ["serve", "run", "deploy.serve_app:build_app", "num_worker=1"],
                ["kubectl", "apply", "-f", "deploy/k8s/nothing.yaml"]):
        with pytest.raises(Exception):
            check_command(bad, monkeypatch)


DOCS = ("reference.md", "guided-output.md", "security.md", "design.md", "models.md")
FILE = re.compile(r"\b((?:tests|bench|deploy|worker|grammar_cache|cluster|scheduler|cli|docs)"
                  r"/[\w./-]+\.(?:py|md|yaml|yml|c))\b")


def test_docs_pages_name_real_files():
    """The pages the README's reference moved to name files that exist (docs/architecture.md
    has its own, stricter test)."""
    missing = []
    for name in ("README.md", *(f"docs/{d}" for d in DOCS)):
        for path in FILE.findall((ROOT / name).read_text()):
            if not (ROOT / path).is_file():
                missing.append(f"{name}: {path}")
    assert not missing, missing


def test_docs_pages_links_reach_headings():
    """Links between the docs pages (``[x](reference.md#limits)``) reach a file and a
    heading."""
    checked = 0
    for name in DOCS:
        page = ROOT / "docs" / name
        for target, anchor in re.findall(r"\]\(([\w.-]+\.md)(?:#([^)]+))?\)", page.read_text()):
            doc = page.parent / target
            assert doc.is_file(), f"docs/{name} links to {target}, which does not exist"
            if anchor:
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", doc.read_text(), re.M)}
                assert anchor in slugs, f"docs/{name} links to {target}#{anchor}: no heading"
            checked += 1
    assert checked >= 10
