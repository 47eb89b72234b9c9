"""One config system: every layer's config is a pydantic model (extra="forbid"), built once
by ClusterConfig into typed sections (launch.up passes them on as objects); every unknown
key and bad value, in any section or at a YAML file's top level, is the one "message
naming the key" (core.config.config_error_message)."""

import ast
import importlib
import pickle
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from cluster.config import ClusterConfig, ServeConfig, WorkerResources
from deploy.loadtest import LoadConfig
from grammar_cache.config import GrammarCacheConfig
from scheduler.actor import SchedulerConfig
from worker.engine.config import EngineConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("cli", "cluster", "deploy", "grammar_cache", "scheduler", "worker")
# classes named like configs that are not settings: a model checkpoint's own config.json,
# the protocol the guided path reads EngineConfig through (worker/guided/rows.py)
NOT_SETTINGS = {"worker.models.loader.ModelConfig", "worker.guided.rows.GuidedConfig"}


def test_the_sections_are_built_once_into_typed_objects():
    config = ClusterConfig(grammar_cache={"compile_timeout_s": 3},
                           scheduler={"max_queued_tokens": 100},
                           engine={"max_num_seqs": 8}, worker={"num_threads": 2})
    assert isinstance(config.grammar_cache, GrammarCacheConfig)
    assert config.grammar_cache.compile_timeout_s == 3
    assert config.scheduler == SchedulerConfig(max_queued_tokens=100)
    assert isinstance(config.engine, EngineConfig) and config.engine.max_num_seqs == 8
    assert isinstance(config.worker, WorkerResources) and isinstance(config.serve, ServeConfig)
    again = pickle.loads(pickle.dumps(config))  # how the sections cross Ray
    assert again == config and again.engine == config.engine


def test_the_engine_follows_the_top_level_unless_its_section_says():
    config = ClusterConfig(model="/m", worker={"num_threads": 3, "num_gpus": 1})
    engine = config.engine
    assert (engine.model, engine.num_threads, engine.progress, engine.device) == (
        "/m", 3, False, "cuda")
    own = ClusterConfig(model="/m", engine={"model": "/e", "num_threads": 1, "device": "cpu"},
                        worker={"num_gpus": 1}).engine
    assert (own.model, own.num_threads, own.device) == ("/e", 1, "cpu")
    built = ClusterConfig(model="/m", engine=EngineConfig(max_num_seqs=4)).engine
    assert (built.model, built.max_num_seqs, built.progress) == ("/m", 4, False)


def test_env_defaults_of_the_engine_are_read_when_built(monkeypatch):
    monkeypatch.setenv("RAYGUIDE_GRAMMAR_ENGINE", "llguidance")
    monkeypatch.setenv("RAYGUIDE_JUMP_FORWARD", "0")
    assert (EngineConfig().grammar_engine, EngineConfig().jump_forward) == ("llguidance", False)
    monkeypatch.setenv("RAYGUIDE_GRAMMAR_ENGINE", "nope")  # a bad default is refused too
    with pytest.raises(ValueError, match=r"^engine\.grammar_engine: must be one of"):
        EngineConfig()


@pytest.mark.parametrize("section, key", [("worker", "num_cpu"), ("engine", "max_num_sequences"),
                                          ("scheduler", "max_queued"),
                                          ("grammar_cache", "timeout"), ("serve", "prot")])
def test_an_unknown_key_in_a_section_is_named_with_the_known_ones(section, key):
    with pytest.raises(ValueError, match=rf"^{section}\.{key}: unknown key; known keys: \w"):
        ClusterConfig(**{section: {key: 1}})


@pytest.mark.parametrize("section, key, value, reason", [
    ("engine", "max_num_seqs", "8", "Input should be a valid integer"),
    ("engine", "loop_guard", "yes", "Input should be a valid boolean"),
    ("engine", "jump_forward", 1, "Input should be a valid boolean"),
    ("engine", "block_size", 0, "Input should be greater than or equal to 1"),
    ("engine", "dtype", "int4", "must be one of"),
    ("engine", "reasoning", {"begin": "<x>"}, r"unknown key\(s\)"),
    ("worker", "num_threads", 1.5, "Input should be a valid integer"),
    ("worker", "num_gpus", "1", "Input should be a valid number"),
    ("scheduler", "max_sessions", True, "Input should be a valid integer"),
    ("scheduler", "rpc_timeout_s", "10", "Input should be a valid number"),
    ("grammar_cache", "replicate", "no", "Input should be a valid boolean"),
    ("grammar_cache", "compile_processes", "many", "Input should be a valid integer"),
    ("serve", "port", "8000", "Input should be a valid integer"),
])
def test_a_bad_value_in_a_section_is_named_with_the_reason(section, key, value, reason):
    with pytest.raises(ValueError, match=rf"^{section}\.{key}: {reason}.*"
                                         + re.escape(f"(got {value!r}")) as err:
        ClusterConfig(**{section: {key: value}})
    assert "Value error" not in str(err.value)


def test_a_section_that_is_not_a_mapping_is_named():
    with pytest.raises(ValueError, match=r"^engine: Input should be a valid dictionary"):
        ClusterConfig(engine=[1])
    with pytest.raises(ValueError, match=r"^num_workers: Input should be greater than or "
                                         r"equal to 1 \(got 0\)"):
        ClusterConfig(num_workers=0)


def test_a_section_built_alone_names_itself():
    with pytest.raises(ValueError, match=r"^engine\.max_num_seqs: Input should be a valid"):
        EngineConfig(max_num_seqs="8")
    with pytest.raises(ValueError, match=r"^scheduler\.max_queued: unknown key; known keys"):
        SchedulerConfig(max_queued=1)
    with pytest.raises(ValueError, match=r"^clinets: unknown key; known keys: .*clients"):
        LoadConfig(clinets=2)


def test_an_assignment_is_checked_and_keeps_working():
    engine = EngineConfig()
    engine.jump_forward = True  # what bench/guided_overhead.py does between runs
    engine.closing_window = 0
    assert engine.jump_forward is True and engine.closing_window == 0
    with pytest.raises(ValueError, match=r"^engine\.closing_window: Input should be a valid "
                                         r"integer \(got '0'\)"):
        engine.closing_window = "0"
    engine.dtype = "bf16"
    assert str(engine.dtype) == "torch.bfloat16"


def test_an_unknown_top_level_key_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_wrokers: 3\n")
    with pytest.raises(ValueError, match=r"c\.yaml: num_wrokers: unknown key; known keys: .*"
                                         r"num_workers"):
        ClusterConfig.from_yaml(path)
    path.write_text("engine: {loop_guard: 'yes'}\n")
    with pytest.raises(ValueError, match=r"c\.yaml: engine\.loop_guard: Input should be a "
                                         r"valid boolean \(got 'yes'\)"):
        ClusterConfig.from_yaml(path)


def test_a_long_value_is_cut_short_in_the_message():
    with pytest.raises(ValueError) as err:
        ClusterConfig(engine={"model": ["x" * 10_000]})
    assert len(str(err.value)) < 300


def _config_classes():
    """Every class of the layers named like a config (…Config, …Settings, …Resources,
    …Limits), found by reading the source, so a new one is checked the day it lands."""
    for path in sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name.endswith(
                    ("Config", "Settings", "Resources", "Limits")):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                if f"{module}.{node.name}" not in NOT_SETTINGS:
                    yield module, node.name


def test_every_config_class_is_a_pydantic_model_that_forbids_unknown_keys():
    found = list(_config_classes())
    names = {name for _, name in found}
    assert {"EngineConfig", "ClusterConfig", "SchedulerConfig", "GrammarCacheConfig",
            "WorkerResources", "ServeConfig", "AppSettings", "Limits", "LoadConfig"} <= names
    wrong = []
    for module, name in found:
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)
                and cls.model_config.get("extra") == "forbid"):
            wrong.append(f"{module}.{name}")
    assert not wrong, f"configs that are not pydantic models with extra='forbid': {wrong}"


def test_a_request_body_error_is_the_same_message_naming_the_field():
    from deploy import openai_api as api
    from deploy.errors import APIError

    with pytest.raises(APIError) as err:
        api.parse_request(api.ChatCompletionRequest, {"messages": [], "max_tokns": 5})
    assert err.value.status == 400 and err.value.param == "max_tokns"
    assert err.value.message.startswith("invalid request: max_tokns: unknown key; known keys:")
    assert "max_tokens" in err.value.message
    with pytest.raises(APIError) as err:
        api.parse_request(api.ChatCompletionRequest, {"messages": "x" * 100_000})
    assert err.value.message.startswith("invalid request: messages: Input should be a valid list")
    assert len(err.value.message) < 300  # the value given is cut short


def test_a_key_that_is_not_a_name_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("1: 2\n")
    with pytest.raises(ValueError, match=r"c\.yaml: keys are names, got 1"):
        ClusterConfig.from_yaml(path)


def test_the_engine_defaults(monkeypatch):
    # what a server runs with when its config names neither: auto engines, jump-forward on
    monkeypatch.delenv("RAYGUIDE_GRAMMAR_ENGINE", raising=False)
    monkeypatch.delenv("RAYGUIDE_JUMP_FORWARD", raising=False)
    assert (EngineConfig().grammar_engine, EngineConfig().jump_forward) == ("auto", True)
