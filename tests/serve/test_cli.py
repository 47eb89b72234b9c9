"""`rayguide generate` end to end: once as a user runs it (a subprocess, the model loaded
from its cache as the command does), and the rest through the same ``cli.main.main`` in
this process over the session's loaded default model (what a subprocess adds, the import
and the model load, is the first test's; each extra subprocess cost 10-20 s of the suite)."""

import json
import re
import subprocess
import sys

import jsonschema
import pytest

pytestmark = pytest.mark.integration


def rayguide(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "cli.main", "generate", "--quiet", *args],
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def generate(monkeypatch, capsys, default_model_dir, default_model, default_tokenizer):
    """``generate(*args, check=True)`` runs ``rayguide generate --quiet *args`` in this
    process: the command's own parsing, engine config, output and exit code, with the
    engine it builds given the session's model instead of loading it again (and a small KV
    cache: the default one takes seconds to allocate). Returns (exit code, stdout, stderr)."""
    from cli.main import main
    from worker.engine import engine as engine_module

    real = engine_module.LLMEngine

    def shared(config, **kw):
        assert config.model is None  # the default model: the one the session loaded
        config = config.model_copy(update={"num_kv_blocks": 256})
        return real(config, model=default_model, tokenizer=default_tokenizer,
                    model_dir=default_model_dir, **kw)

    monkeypatch.setattr(engine_module, "LLMEngine", shared)

    def run(*args, check=True):
        capsys.readouterr()
        try:
            code = main(["generate", "--quiet", *args])
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
        out, err = capsys.readouterr()
        if check:
            assert code == 0, err
        return code, out, err

    return run


def test_plain_prompt_as_a_subprocess(default_model_dir):
    out = rayguide("--prompt", "What is the capital of France?", "--max-tokens", "12").stdout
    assert "Paris" in out


def test_json_schema_output_is_exactly_the_json(generate, tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    _, out, _ = generate("--prompt", "Describe a person as JSON.", "--json-schema", str(path),
                         "--max-tokens", "64")
    jsonschema.validate(json.loads(out), schema)


def test_choice_and_regex(generate):
    _, out, _ = generate("--prompt", "Is fire hot?", "--choice", "yes", "--choice", "no")
    assert out.strip() in ("yes", "no")
    _, out, _ = generate("--prompt", "A year?", "--regex", "(19|20)[0-9]{2}")
    assert re.fullmatch("(19|20)[0-9]{2}", out.strip())


def test_prompts_file(generate, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Say hi.\nSay bye.\n")
    _, out, _ = generate("--prompts-file", str(path), "--max-tokens", "8")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["Say hi.", "Say bye."]
    assert all(r["text"] and r["finish_reason"] in ("stop", "length") for r in rows)


def test_errors_name_the_problem(generate):
    code, _, err = generate("--prompt", "x", "--max-tokens", "0", check=False)
    assert code == 2 and "max_new_tokens" in err
    code, _, err = generate("--prompt", "x", "--regex", "a", "--json-object", check=False)
    assert code == 2 and "one guided flag" in err
    code, _, err = generate("--prompt", "x", "--regex", "(a", check=False)
    assert code == 1 and "invalid regex grammar" in err
