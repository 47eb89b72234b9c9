"""ClusterConfig checks its sections once and keeps the grammar cache and scheduler
configs it builds (launch.up passes them on as objects); every unknown key, in any
section or at a YAML file's top level, is the one "message naming the key"
(grammar_cache.config.config_error_message)."""

import dataclasses
import pickle

import pytest

from cluster.config import ClusterConfig
from grammar_cache.config import GrammarCacheConfig
from scheduler.actor import SchedulerConfig

pytestmark = pytest.mark.unit


def test_the_built_section_configs_are_kept_and_rebuilt_by_replace():
    config = ClusterConfig(grammar_cache={"compile_timeout_s": 3},
                           scheduler={"max_queued_tokens": 100})
    assert isinstance(config.grammar_cache_config, GrammarCacheConfig)
    assert config.grammar_cache_config.compile_timeout_s == 3
    assert config.scheduler_config == SchedulerConfig(max_queued_tokens=100)
    again = dataclasses.replace(config, grammar_cache={"compile_timeout_s": 4})
    assert again.grammar_cache_config.compile_timeout_s == 4
    assert pickle.loads(pickle.dumps(config)).grammar_cache_config == config.grammar_cache_config


@pytest.mark.parametrize("section, key", [("worker", "num_cpu"), ("engine", "max_num_sequences"),
                                          ("scheduler", "max_queued"),
                                          ("grammar_cache", "timeout")])
def test_an_unknown_key_in_a_section_is_named_with_the_known_ones(section, key):
    with pytest.raises(ValueError, match=rf"^{section}\.{key}: unknown key; known keys: \w"):
        ClusterConfig(**{section: {key: 1}})


def test_an_unknown_top_level_key_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_wrokers: 3\n")
    with pytest.raises(ValueError, match=r"c\.yaml: num_wrokers: unknown key; known keys: .*"
                                         r"num_workers") as err:
        ClusterConfig.from_yaml(path)
    assert "grammar_cache_config" not in str(err.value)  # built, never given
