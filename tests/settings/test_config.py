"""Settings: file < environment < flags, validated once with errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.settings.config import Settings, load_settings

from inferd.settings.values import SettingsError, parse_memory
from inferd.engine.config import EngineConfig

REPO_TOML = Path(__file__).resolve().parents[2] / "inferd.toml"


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    toml = tmp_path / "inferd.toml"
    toml.write_text('[cache]\nblock_size = 8\nkv_cache_memory = "1GiB"\n[scheduler]\nmax_num_seqs = 4\n')
    env = {"INFERD_CACHE_BLOCK_SIZE": "32", "INFERD_SCHEDULER_MAX_NUM_SEQS": "9"}
    settings = load_settings(toml, {"scheduler": {"max_num_seqs": 12}}, environ=env)
    assert settings.cache.block_size == 32  # env beats the file
    assert settings.cache.kv_cache_memory == 2**30  # the file beats the default
    assert settings.scheduler.max_num_seqs == 12  # flags beat env
    config = EngineConfig.from_settings(settings)
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.cache.kv_cache_memory) == (32, 12, 2**30)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"cache": {"block_size": 12}}, "cache.block_size"),
        ({"model": {"dtype": "fp8"}}, "model.dtype"),
        ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs"),
        ({"cache": {"kv_cache_memory": "lots"}}, "cache.kv_cache_memory"),
        ({"cache": {"kv_cache_memory": -1}}, "cache.kv_cache_memory"),
        ({"cache": {"bogus": 1}}, "cache.bogus"),
    ],
)
def test_invalid_values_name_their_key(overrides: dict, needle: str) -> None:
    with pytest.raises(SettingsError, match=needle.replace(".", r"\.")):
        load_settings(None, overrides, environ={})


def test_classes_start_from_the_builtin_ones_and_replace_them(tmp_path: Path) -> None:
    toml = tmp_path / "inferd.toml"
    toml.write_text('[scheduler]\ndefault_class = "batch"\n[classes.batch]\nttft_target = 9.5\n'
                    '[classes.bulk]\npriority = 7\nqueue_timeout = 30\n')
    policy = load_settings(toml, environ={}).policy()
    assert [c.name for c in policy.ranked] == ["batch", "bulk"]  # interactive is gone
    batch, bulk = policy.ranked
    assert batch.ttft_target == 9.5 and batch.sheddable and batch.kv_reserve == 0.1  # the rest built in
    assert bulk.timeouts.queue == 30 and bulk.timeouts.total is None  # 0 (the default) means none
    assert policy.lookup(7) is bulk and policy.lookup(None) is batch


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('[classes.a]\npriority = 0\n[classes.b]\npriority = 0\n', "numbers must be unique"),
        ('[scheduler]\ndefault_class = "nope"\n', "default_class 'nope'"),
        ('[classes.x]\nttft_target = 1\n', "missing setting classes.x.priority"),
        ('[classes.interactive]\nkv_reserve = 1.5\n', "classes.interactive.kv_reserve"),
        ('[scheduler]\npreemption_mode = "drop"\n', "scheduler.preemption_mode"),
    ],
)
def test_invalid_classes_are_named(tmp_path: Path, toml: str, needle: str) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(toml)
    with pytest.raises(SettingsError, match=needle):
        load_settings(path, environ={})


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache\nblock_size = ")
    with pytest.raises(SettingsError, match="invalid TOML"):
        load_settings(bad)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2GiB", 2 * 2**30), ("512MB", 512e6), ("0.5", 0.5), (0.25, 0.25), (1048576, 1048576), ("16 KiB", 16384)],
)
def test_memory_sizes(value: object, expected: float) -> None:
    assert parse_memory(value) == expected


def test_the_engine_config_takes_its_defaults_from_the_settings() -> None:
    assert EngineConfig() == EngineConfig.from_settings(Settings())  # one copy of every default
