"""API keys: digests in, constant-time checks, open paths, and the keys file's errors."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
from apiserver import assert_error, serve

from inferd.api.gateway.keys import load_api_keys
from inferd.settings.config import Settings
from inferd.settings.values import SettingsError
from inferd.engine.llm_engine import LLMEngine

KEY = "sk-test-0123456789"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.mark.served
@pytest.mark.asyncio
async def test_missing_wrong_and_right_key(llm: LLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with serve(llm, api_keys=load_api_keys([KEY], None, None)) as server:
        assert_error(*await server.get("/v1/models"), 401, code="invalid_api_key")
        wrong = {"Authorization": "Bearer sk-wrong"}
        assert_error(*await server.get("/v1/models", headers=wrong), 401, code="invalid_api_key")
        basic = {"Authorization": f"Basic {KEY}"}
        assert_error(*await server.get("/v1/models", headers=basic), 401, code="invalid_api_key")
        status, body = await server.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200 and body["data"][0]["id"] == "smollm2"
    assert "sk-wrong" not in caplog.text and KEY not in caplog.text


@pytest.mark.served
@pytest.mark.asyncio
async def test_401_comes_before_validation(llm: LLMEngine) -> None:
    async with serve(llm, api_keys=load_api_keys([KEY], None, None)) as server:
        status, body = await server.post("/v1/completions", {"model": "smollm2", "temperature": 9})
        assert_error(status, body, 401)


@pytest.mark.served
@pytest.mark.asyncio
async def test_open_paths_need_no_key(llm: LLMEngine) -> None:
    async with serve(llm, api_keys=load_api_keys([KEY], None, None)) as server:
        status, body = await server.get("/health")
        assert status == 200 and body == {"status": "ok"}
        assert_error(*await server.get("/v1/status"), 401)
    settings = Settings.model_validate({"server": {"open_paths": ["/health", "/v1/status"]}})
    async with serve(llm, settings, load_api_keys([KEY], None, None)) as server:
        status, body = await server.get("/v1/status")
        assert status == 200 and body["model"] == "smollm2"


@pytest.mark.served
@pytest.mark.asyncio
async def test_keys_file_with_digests(llm: LLMEngine, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# team keys\n{sha('sk-alice')}\n\n{sha('sk-bob').upper()}  # bob\n")
    keys = load_api_keys([], "sk-env-1, sk-env-2", str(keys_file))
    assert keys == {sha("sk-alice"), sha("sk-bob"), sha("sk-env-1"), sha("sk-env-2")}
    async with serve(llm, api_keys=keys) as server:
        for key in ("sk-alice", "sk-bob", "sk-env-2"):
            status, _ = await server.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert status == 200, key
        # the digest itself is not a key
        assert_error(*await server.get("/v1/models", headers={"Authorization": f"Bearer {sha('sk-alice')}"}), 401)


def test_no_keys_means_open() -> None:
    assert load_api_keys([], None, None) == frozenset()
    assert load_api_keys(["", " "], " , ", None) == frozenset()


def test_malformed_keys_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{sha('a')}\nsk-pasted-in-the-clear\n")
    with pytest.raises(SettingsError, match=r"keys.* line 2 ") as err:
        load_api_keys([], None, str(keys_file))
    assert "sk-pasted-in-the-clear" not in str(err.value)


def test_unreadable_keys_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read .*missing"):
        load_api_keys([], None, str(tmp_path / "missing"))
