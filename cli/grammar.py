"""``rayguide grammar check FILE...``: the grammar check of ``POST /v1/grammars``
(worker/guided/grammar_check.py, docs/grammars.md) on this machine, with no server: the
model's tokenizer (not its weights), the engine's default grammar engine, xgrammar's
compiles in a child process under the grammar cache's limits (compile_timeout_s,
compile_memory_mb), as the shared cache compiles them.

A FILE is JSON: a request body (any chat or completion request, or just its guided
fields: ``response_format``, ``guided_json``, ``tools``, ...; read by the endpoint's own
code), or a bare JSON schema (JSONSchemaBench's ``{"schema", "tests"}`` files too); a
``.ebnf`` / ``.gbnf`` / ``.lark`` file is a grammar of that kind. Prints a line per file
(``--json``: the reports, one JSON object a line); exits 0 when every grammar compiles,
1 when one is refused, 2 when a file cannot be read as a grammar.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the keys that make a JSON file a request body rather than a schema
_BODY_KEYS = ("response_format", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "structured_outputs", "tools", "grammar_id", "messages",
              "prompt", "guided_decoding_backend")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="a request body, a JSON schema, "
                   "or an .ebnf / .gbnf / .lark grammar")
    p.add_argument("--model", default=None, help="HF dir, .gguf file or hf:org/name@revision "
                   "(default: the default model); only its tokenizer is loaded")
    p.add_argument("--engine", default=None, choices=["auto", "xgrammar", "llguidance"],
                   help="the server's default grammar engine (default: as `rayguide serve`)")
    p.add_argument("--json", action="store_true", help="print each report as one JSON line")


def spec_of(path: Path):
    """The GrammarSpec a file asks for (the endpoint's reading of a body); raises
    ValueError (an APIError's message) when it is no grammar."""
    from deploy import dialects
    from deploy import openai_api as api
    from deploy.errors import APIError
    from deploy.settings import Limits
    from core.grammar_spec import GrammarSpec

    text = path.read_text()
    suffix = path.suffix.lower()
    if suffix in (".ebnf", ".gbnf"):
        return GrammarSpec.ebnf(text)
    if suffix == ".lark":
        return GrammarSpec.lark(text)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    try:
        if isinstance(value, dict) and any(k in value for k in _BODY_KEYS):
            if "grammar_id" in value:
                raise ValueError("grammar_id names a grammar a server checked; give the "
                                 "grammar itself here")
            req = api.parse_request(api.GrammarCheckRequest, value)
            return api.check_spec(req, Limits())
        if isinstance(value, dict) and isinstance(value.get("schema"), (dict, bool)) \
                and "tests" in value:
            value = value["schema"]  # a JSONSchemaBench file: the schema and its tests
        return dialects.json_schema(value)
    except APIError as exc:
        raise ValueError(exc.message) from None
    except dialects.DialectError as exc:
        raise ValueError(str(exc)) from None


class LocalChecker:
    """A GrammarChecker over the model's tokenizer, with xgrammar compiled in a child
    process under the cache's limits."""

    def __init__(self, model: str | None, engine: str | None):
        from grammar_cache import envelope
        from grammar_cache.compile_pool import CompilePool
        from grammar_cache.config import GrammarCacheConfig
        from worker.engine.config import EngineConfig
        from worker.guided.grammar_check import GrammarChecker
        from worker.guided.guided_process import GuidedDecodingManager
        from worker.models import loader

        model_dir = loader.resolve_model_dir(model, progress=False)
        tokenizer = loader.load_tokenizer(model_dir)
        vocab_size = int(loader.load_config(model_dir).vocab_size)
        self.model = Path(model_dir).name if model else None
        config = GrammarCacheConfig()
        self.pool = CompilePool(config, processes=1)
        self.pool.wait_ready()  # (its imports are no part of the first compile's time)

        def fetch_factory(info):
            tokenizer_json = info.serialize_json()

            def fetch(spec, _client=None):
                fingerprint = guided.fingerprint
                key = spec.key(fingerprint)
                result = self.pool.compile(spec, fingerprint, tokenizer_json, key)
                return envelope.unpack(result.data, info, fingerprint, key)
            return fetch

        guided = GuidedDecodingManager.from_tokenizer(
            tokenizer, vocab_size, loader.generation_eos_ids(model_dir, tokenizer),
            grammar_fetch=fetch_factory,
            default_engine=engine or EngineConfig().grammar_engine)
        self.guided = guided
        self.checker = GrammarChecker(guided)

    def check(self, spec) -> dict:
        return self.checker.check(spec).as_dict()

    def close(self) -> None:
        self.pool.close()
        self.guided.shutdown()


def summary(name: str, report: dict) -> str:
    """One line: the verdict, the engine, the shortest output, compile time, keywords."""
    short = report["shortest_output"]
    if report["status"] == "refused":
        return f"{name}: refused ({report['error']['code']}): {report['error']['message']}"
    tokens = short["tokens"] if short["tokens"] is not None else "?"
    line = (f"{name}: {report['status']} on {report['engine']}; shortest output {tokens} "
            f"tokens (at least {short['at_least']}); compiled in {report['compile_ms']:.1f} ms"
            f"; {report['id']}")
    engine = report["engines"][report["engine"]]
    if engine["keywords"]:
        line += "; approximates " + ", ".join(f"{k['keyword']} at {k['path'] or '/'}"
                                              for k in engine["keywords"])
    other = [n for n, v in report["engines"].items()
             if n != report["engine"] and v["verdict"] == "refused"]
    for name_ in other:
        line += f"; {name_} refuses it: {report['engines'][name_]['message']}"
    return line


def run(args) -> int:
    specs, code = [], 0
    for name in args.files:
        try:
            specs.append((name, spec_of(Path(name))))
        except (OSError, ValueError) as exc:
            print(f"rayguide: {name}: {exc}", file=sys.stderr)
            code = 2
    if not specs:
        return code
    checker = LocalChecker(args.model, args.engine)
    try:
        for name, spec in specs:
            try:
                report = checker.check(spec)
            except Exception as exc:  # noqa: BLE001 - a compile process that failed
                print(f"rayguide: {name}: the check failed ({type(exc).__name__}: {exc})",
                      file=sys.stderr)
                code = max(code, 1)
                continue
            report["file"] = name
            print(json.dumps(report) if args.json else summary(name, report), flush=True)
            if report["status"] == "refused":
                code = max(code, 1)
    finally:
        checker.close()
    return code
