"""No module of the runtime over about 500 lines without a reason written at its top
(issue 40): a module that grows past it says, in its docstring, why it is one module
(``Why one module`` ...), so the next change either splits it or keeps the reason true."""

import ast

import pytest

from tests.unit.test_layers_unit import runtime_modules

pytestmark = pytest.mark.unit

LIMIT = 500


def test_long_modules_say_why_they_are_one():
    unexplained = []
    for name, path in runtime_modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines <= LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "one module" not in doc.lower():
            unexplained.append(f"{name} ({lines} lines)")
    assert not unexplained, ("modules over ~500 lines without a 'Why one module' reason at "
                             f"their top (split them or write it): {unexplained}")


def test_the_check_sees_the_runtime():
    # a check that finds no module checks nothing
    mods = runtime_modules()
    assert "worker.engine.engine" in mods and "deploy.serve_app" in mods
