"""Two models in one real `inferd serve` process, with the official openai client: each answers
by its name and alias, and SIGHUP reloads the model whose [models.NAME] table changed (a new
revision takes over; the other model is left alone). Model b is the default GGUF; model a, the one
reloaded, a tiny random Llama folder in the default tier (what is checked is which model and
revision answer, not what they say; each GGUF load is seconds on two cores), the GGUF too in the
soak tier. And models loaded on demand only (issue 46): the server starts and is ready with none
loaded, a request loads its model from the file, and a SIGHUP only updates what an unloaded model
loads next."""

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

from inferd.api.startup import StartupLine

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


ON_DEMAND = """
[model]
max_model_len = 256
[server]
models_max = 1
[models.a]
load = "on_demand"
kv_cache_memory = "16MiB"
[models.b]
load = "on_demand"
revision = "{revision}"
kv_cache_memory = "16MiB"
"""


def cards(url: str) -> dict[str, dict[str, object]]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return {card["id"]: card for card in json.load(r)["data"]}


def test_serve_with_only_models_on_demand_starts_ready_and_loads_on_the_first_request(tmp_path: Path) -> None:
    config = tmp_path / "inferd.toml"
    config.write_text(ON_DEMAND.format(revision="1"))
    server = start_server(tmp_path, "--config", str(config))  # (returns once /ready is 200)
    try:
        lines = StartupLine.parse_all(server.log.read_text())
        assert [(line.name, line.architecture) for line in lines] == [("a@1", "on-demand"), ("b@1", "on-demand")]
        assert {name: card["state"] for name, card in cards(server.url).items()} == {"a": "unloaded", "b": "unloaded"}
        body = json.dumps({"model": "a", "prompt": "Hello", "max_tokens": 2}).encode()
        request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            assert (r.status, r.headers["x-inferd-model"]) == (200, "a@1")
        assert cards(server.url)["a"]["state"] == "serving" and cards(server.url)["a"]["max_model_len"] == 256
        config.write_text(ON_DEMAND.format(revision="2"))
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while cards(server.url)["b"]["revision"] != "2":
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.1)
        assert cards(server.url)["b"]["state"] == "unloaded"
    finally:
        stop_server(server)
    assert "b@2: not loaded; it loads this revision when next asked" in server.log.read_text()
