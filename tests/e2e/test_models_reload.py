"""Two models in one real `inferd serve` process, with the official openai client: each answers
by its name and alias, and SIGHUP reloads the model whose [models.NAME] table changed (a new
revision takes over; the other model is left alone). Model b is the default GGUF; model a, the one
reloaded, a tiny random Llama folder in the default tier (what is checked is which model and
revision answer, not what they say; each GGUF load is seconds on two cores), the GGUF too in the
soak tier."""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from serveproc import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
import tiny_models  # (tests/model's builders of tiny checkpoints)

pytestmark = pytest.mark.served  # it starts a real server

CONFIG = """
[model]
max_model_len = 256
[models.a]
{path}revision = "{revision}"
aliases = ["alpha"]
kv_cache_memory = "16MiB"
[models.b]
revision = "1"
kv_cache_memory = "16MiB"
"""


def revisions(url: str) -> dict[str, str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return {card["id"]: card["revision"] for card in json.load(r)["data"]}


def tiny_llama_folder(folder: Path) -> Path:
    vocab = tiny_models.train_sentencepiece(folder)
    tiny_models.tiny_llama(vocab, seed=1).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("model_a", [pytest.param("gguf", marks=pytest.mark.soak), "tiny"])
def test_two_models_answer_by_name_and_sighup_reloads_the_changed_one(tmp_path: Path, model_a: str) -> None:
    path = "" if model_a == "gguf" else f'path = "{tiny_llama_folder(tmp_path / "tiny-llama")}"\n'
    config = tmp_path / "inferd.toml"
    config.write_text(CONFIG.format(path=path, revision="1"))
    server = start_server(tmp_path, "--config", str(config))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for name, answered in (("a", "a"), ("alpha", "a"), ("b", "b")):
            raw = client.completions.with_raw_response.create(model=name, prompt="Hello", max_tokens=2)
            assert (raw.parse().model, raw.headers["x-inferd-model"]) == (answered, f"{answered}@1")
        assert revisions(server.url) == {"a": "1", "alpha": "1", "b": "1"}
        config.write_text(CONFIG.format(path=path, revision="2"))
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while revisions(server.url)["a"] != "2":
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.2)
        assert revisions(server.url) == {"a": "2", "alpha": "2", "b": "1"}
        raw = client.completions.with_raw_response.create(model="alpha", prompt="Hello", max_tokens=2)
        assert raw.headers["x-inferd-model"] == "a@2"
    finally:
        stop_server(server)
    log = server.log.read_text()
    assert "SIGHUP: a@2 serves" in log and "revision 1 retired" in log
