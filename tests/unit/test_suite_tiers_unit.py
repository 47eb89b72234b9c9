"""tests/suite.sh (`make test`, what CI runs): its three tiers hold every test file once,
the suite fails when any tier fails (all of them run), and the engine tier's launcher
(tests/lowered.py) runs its command in a session of its own at the lowest priority."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for the venv's python: records each call, runs what tests/lowered.py would run
if [ "$1" = tests/lowered.py ]; then echo "lowered $2" >> "$CALLS"; shift 2; exec "$@"; fi
echo "$*" >> "$CALLS"
case "$*" in *"$FAIL_ON"*) [ -n "$FAIL_ON" ] && exit 3;; esac
exit 0
"""


def run_suite(tmp_path: Path, fail_on: str = "") -> tuple[int, list[str]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / f"calls-{len(list(tmp_path.iterdir()))}"
    env = dict(os.environ, CALLS=str(calls), FAIL_ON=fail_on)
    proc = subprocess.run(["bash", str(TESTS / "suite.sh"), str(fake)], env=env,
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, calls.read_text().splitlines()


def collected(args: list[str]) -> set[Path]:
    """The test files a pytest call with these arguments would collect."""
    ignore = [a.split("=", 1)[1] for a in args if a.startswith("--ignore-glob=")]
    files = set()
    for arg in args:
        path = ROOT / arg
        if arg.startswith("-") or not path.exists():
            continue
        found = path.rglob("test_*.py") if path.is_dir() else [path]
        files |= {f for f in found if not any(f.match(g) for g in ignore)}
    return files


def test_the_tiers_hold_every_test_file_once(tmp_path):
    rc, calls = run_suite(tmp_path)
    assert rc == 0
    pytest_calls = [shlex.split(c) for c in calls if " -m pytest " in f" {c} "]
    assert len(pytest_calls) == 3, calls
    tiers = [collected(args) for args in pytest_calls]
    everything = set(TESTS.rglob("test_*.py"))
    assert set().union(*tiers) == everything, sorted(everything - set().union(*tiers))
    assert sum(len(t) for t in tiers) == len(everything)  # no file in two tiers
    # the engine tier (the one launched lowered) is the in-process engine tests
    assert "lowered 10" in calls
    engine = [tier for args, tier in zip(pytest_calls, tiers) if "tests/engine" in args]
    assert len(engine) == 1 and engine[0]
    assert all(f.parent == TESTS / "engine" for f in engine[0])


@pytest.mark.parametrize("fail_on", ["tests/unit", "--ignore-glob=*_unit.py tests/engine",
                                     "tests/cluster tests/serve"])
def test_the_suite_fails_when_any_tier_fails_and_runs_them_all(tmp_path, fail_on):
    rc, calls = run_suite(tmp_path, fail_on)
    assert rc == 3, calls
    assert sum(" -m pytest " in f" {c} " for c in calls) == 3, calls


def test_lowered_runs_its_command_in_a_session_of_its_own_at_nice_19():
    probe = ("import os; print(os.getsid(0) == os.getpid(), os.nice(0)); "
             "p = '/proc/self/autogroup'; print(open(p).read().strip() if os.path.exists(p) "
             "else '')")
    out = subprocess.run([sys.executable, str(TESTS / "lowered.py"), "7", sys.executable,
                          "-c", probe], capture_output=True, text=True, check=True,
                         timeout=30).stdout.splitlines()
    assert out[0] == "True 19"
    enabled = Path("/proc/sys/kernel/sched_autogroup_enabled")
    if enabled.exists() and enabled.read_text().strip() == "1":
        assert out[1].endswith("nice 7"), out



def test_the_engine_tier_s_longest_files_exist_and_go_first():
    """tests/conftest.py orders tests/engine's files longest first (a renamed file would
    silently drop to the end) and keeps each file's tests together, in their order."""
    from types import SimpleNamespace

    from tests.conftest import ENGINE_LONGEST_FIRST, pytest_collection_modifyitems

    paths = sorted((TESTS / "engine").glob("test_*.py"))
    assert set(ENGINE_LONGEST_FIRST) <= {p.name for p in paths}
    items = [SimpleNamespace(path=p, name=f"{p.name}::{i}", fixturenames=[], keywords={},
                             add_marker=lambda marker: None) for p in paths for i in range(2)]
    pytest_collection_modifyitems(None, items)
    files = list(dict.fromkeys(item.path.name for item in items))
    assert files[:len(ENGINE_LONGEST_FIRST)] == list(ENGINE_LONGEST_FIRST)
    assert len(files) == len(paths)  # each file's tests together
    assert [item.name for item in items if item.path == paths[0]] == \
        [f"{paths[0].name}::0", f"{paths[0].name}::1"]
