"""The API fuzzed from its own GET /openapi.json: schemathesis against a real `inferd serve`.

Every operation runs twice, with the API key and without one, on valid and invalid requests
(schemathesis's positive and negative modes). Each response must be no server error (< 500),
have a documented status code and content type, and match its documented schema (SSE streams
event by event). A request that takes longer than REQUEST_TIMEOUT fails as a hang, and the
server must log no traceback. The server keeps each generation tiny (8 tokens at most, a short
context, a small KV cache) and the examples are few and derandomized, so each run sends the same
requests; the default tier sends a fifth as many as the soak tier (~20 s against ~100 s on 2 cores).

NOTE: each operation's cases come from `operation.as_strategy()` under a plain `@given`, not from
`schemathesis.pytest.from_fixture(...).parametrize()`: that loader reads `request.node._nodeid`,
which pytest 9.2 no longer has. A response the server really gives that the document lacks is
fixed in the document (inferd/api/endpoints.py), not in the checks.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from serveproc import Server, start_server, stop_server  # noqa: E402  (tests/e2e's real-subprocess helpers)

from inferd.api.openapi import openapi_document  # noqa: E402

pytestmark = pytest.mark.served  # it starts a real server

MODEL = "smollm2"
KEY = "sk-fuzz-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
REQUEST_TIMEOUT = 30.0  # seconds; longer is a hang
# examples per operation and run: a generation costs up to 8 decode steps, a 401 or a tokenizer
# call next to nothing (but without the key the body is never read: a few say all there is).
# The soak tier sends them all, the default tier a fifth as many (each derandomized).
GENERATE_EXAMPLES, CHEAP_EXAMPLES, NO_KEY_EXAMPLES = 60, 300, 30
GENERATING = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}  # the rest: cheap
TIERS = [pytest.param(1, marks=pytest.mark.soak, id="all"), pytest.param(5, id="a-fifth")]

# tiny generations: 8 tokens at most (default 8), 256 tokens of context, 2 choices, 2 prompts
CONFIG = """
[server]
api_keys_file = "keys.sha256"
probe_interval_seconds = 0
keepalive_seconds = 60  # (a stream that hangs sends nothing, and its read times out)
drain_seconds = 1
[limits]
max_tokens_default = 8
max_tokens_limit = 8
max_n = 2
max_prompts = 2
[model]
name = "smollm2"
dtype = "float32"
device = "cpu"
max_model_len = 256
[cache]
kv_cache_memory = "32MiB"
[scheduler]
max_num_seqs = 8
max_num_batched_tokens = 256
[shedding]
enabled = false
[classes.interactive]
max_tokens = 8
[classes.batch]
max_tokens = 8
"""


def no_server_error(ctx: schemathesis.CheckContext, response: schemathesis.Response,
                    case: schemathesis.Case) -> bool | None:
    """not_a_server_error, less the 503 of a request ended by a timeout it set itself before its
    first token (`"total_timeout": 5e-324`): documented, and the answer it asked for."""
    if response.status_code == 503 and isinstance(case.body, dict):
        error = response.json().get("error") or {}
        code = error.get("code") or ""
        if error.get("type") == "timeout_error" and case.body.get(code) is not None:
            return None
    return not_a_server_error(ctx, response, case)


CHECKS = [no_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("fuzz")
    (path / "keys.sha256").write_text(hashlib.sha256(KEY.encode()).hexdigest() + "\n")
    (path / "inferd.toml").write_text(CONFIG)
    srv = start_server(path, "--config", str(path / "inferd.toml"))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def api_schema(server: Server) -> schemathesis.BaseSchema:
    # no generated Authorization header: the runs below send the key, or none; failures show
    # every field (sanitizing would hide max_tokens, tokens, ... for the "token" in their names)
    config = schemathesis.Config.from_dict({"generation": {"with-security-parameters": False},
                                            "output": {"sanitization": {"enabled": False}}})
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config, headers=AUTH,
                                         timeout=REQUEST_TIMEOUT)


SETTINGS = hypothesis.settings(
    deadline=None, derandomize=True, database=None,
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],  # no shrinking: a failure reports at once
    suppress_health_check=list(hypothesis.HealthCheck),
)
# (method, path, mode): invalid requests only where there is a body to get wrong
CASES = [(method.upper(), path, mode) for path, item in openapi_document()["paths"].items()
         for method, operation in item.items()
         for mode in GenerationMode if mode == GenerationMode.POSITIVE or "requestBody" in operation]


def served_model(case: schemathesis.Case) -> schemathesis.Case:
    """Name the served model where the case names one (else nearly every request is a 404)."""
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL
    return case


@pytest.mark.parametrize("divisor", TIERS)
@pytest.mark.parametrize("key", [True, False], ids=["key", "no-key"])
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g}" for m, p, g in CASES])
def test_operation(api_schema: schemathesis.BaseSchema, server: Server, method: str, path: str,
                   mode: GenerationMode, key: bool, divisor: int) -> None:
    headers = AUTH if key else None
    examples = NO_KEY_EXAMPLES if not key else GENERATE_EXAMPLES if path in GENERATING else CHEAP_EXAMPLES
    examples = max(1, examples // divisor)

    @hypothesis.given(case=api_schema[path][method].as_strategy(generation_mode=mode).map(served_model))
    @hypothesis.settings(SETTINGS, max_examples=examples)
    def run(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=server.url, headers=headers, checks=CHECKS, timeout=REQUEST_TIMEOUT)

    run()


def test_no_traceback_logged(server: Server) -> None:
    """A handler's unexpected exception is logged with its traceback (and answered 500)."""
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", server.log.read_text())
    tracebacks = [record for record in records if "Traceback" in record]
    assert not tracebacks, "\n".join(tracebacks[:3])
