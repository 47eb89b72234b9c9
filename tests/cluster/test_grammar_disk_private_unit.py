"""The grammar disk tier loads a file only when it and its folders are this user's alone
(grammar_cache/private_files.py, the check the kernels and converted models get)."""

import os
import stat

import pytest

from grammar_cache.disk import DiskStore
from grammar_cache.private_files import check_private

pytestmark = pytest.mark.unit

DATA = b"an envelope"


@pytest.fixture
def store(tmp_path):
    s = DiskStore(tmp_path / "grammars")
    s._root = s.base / "xgr-test-s1"  # the version folder without importing xgrammar
    return s


def mode(p) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_written_folders_are_private_whatever_the_umask(store):
    old = os.umask(0o002)
    try:
        assert store.put("fp", "k", DATA)
    finally:
        os.umask(old)
    p = store.path("fp", "k")
    for folder in (store.base, store.root, p.parent):
        assert mode(folder) == 0o755, folder
    assert not mode(p) & 0o022
    assert store.get("fp", "k") == DATA
    check_private(p, store.base)


@pytest.mark.parametrize("which", ["base", "version", "fingerprint", "file"])
def test_a_file_others_could_write_is_not_loaded(store, which):
    assert store.put("fp", "k", DATA)
    p = store.path("fp", "k")
    target = {"base": store.base, "version": store.root, "fingerprint": p.parent,
              "file": p}[which]
    target.chmod(mode(target) | 0o002)
    errors = store.stats()["disk_errors"]
    assert store.get("fp", "k") is None  # a failed read: the grammar is compiled instead
    assert store.stats()["disk_errors"] == errors + 1
    with pytest.raises(PermissionError, match="chmod go-w"):
        check_private(p, store.base)
    target.chmod(mode(target) & ~0o022)
    assert store.get("fp", "k") == DATA


def test_a_missing_file_is_a_plain_miss(store):
    assert store.get("fp", "absent") is None
    assert store.stats()["disk_errors"] == 0
