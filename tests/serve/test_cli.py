"""`rayguide generate` end to end, as a user runs it (a subprocess)."""

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


def test_plain_prompt(default_model_dir):
    out = rayguide("--prompt", "What is the capital of France?", "--max-tokens", "12").stdout
    assert "Paris" in out


def test_json_schema_output_is_exactly_the_json(default_model_dir, tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    out = rayguide("--prompt", "Describe a person as JSON.", "--json-schema", str(path),
                   "--max-tokens", "64").stdout
    jsonschema.validate(json.loads(out), schema)


def test_choice_and_regex(default_model_dir):
    out = rayguide("--prompt", "Is fire hot?", "--choice", "yes", "--choice", "no").stdout
    assert out.strip() in ("yes", "no")
    out = rayguide("--prompt", "A year?", "--regex", "(19|20)[0-9]{2}").stdout
    assert re.fullmatch("(19|20)[0-9]{2}", out.strip())


def test_prompts_file(default_model_dir, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Say hi.\nSay bye.\n")
    lines = rayguide("--prompts-file", str(path), "--max-tokens", "8").stdout.splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in rows] == ["Say hi.", "Say bye."]
    assert all(r["text"] and r["finish_reason"] in ("stop", "length") for r in rows)


def test_errors_name_the_problem(default_model_dir):
    bad = rayguide("--prompt", "x", "--max-tokens", "0", check=False)
    assert bad.returncode == 2 and "max_new_tokens" in bad.stderr
    both = rayguide("--prompt", "x", "--regex", "a", "--json-object", check=False)
    assert both.returncode == 2 and "one guided flag" in both.stderr
    grammar = rayguide("--prompt", "x", "--regex", "(a", check=False)
    assert grammar.returncode == 1 and "invalid regex grammar" in grammar.stderr
