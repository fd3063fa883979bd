"""The server's settings tables: [server], [tenants.NAME], [responses], [output_filter] and
[request_log]. Each key's docstring is its one description (settings/docs.py and defaults.py make
the rest)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from inferd.settings.values import DIGEST_HINT, SHA256_HEX, SIZE, Section, parse_memory


def digests(values: tuple[str, ...]) -> tuple[str, ...]:
    """Key digests as settings hold them, lower-cased; ValueError for one that is not a digest."""
    for number, value in enumerate(values):
        if not SHA256_HEX.fullmatch(value):
            # NOTE: the value is not echoed: it may be a key pasted in the clear
            raise ValueError(f"entry {number} is not a SHA-256 hex digest ({DIGEST_HINT})")
    return tuple(v.lower() for v in values)


class ServerSettings(Section):
    """The HTTP server."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port to bind; 0: any free port."""
    api_keys_file: str | None = Field(default=None, examples=["/etc/inferd/api_keys"])
    """SHA-256 hex digests of the accepted API keys (`printf %s KEY | sha256sum`), one per line ('#'
    comments allowed); keys also come from --api-key and INFERD_API_KEYS (comma-separated, in the
    clear). No key at all: open."""
    open_paths: tuple[str, ...] = ("/health", "/ready", "/metrics")
    """Paths served without a key."""
    keepalive_seconds: float = Field(default=10.0, gt=0, le=300)
    """An SSE comment this often while a stream waits in the queue."""
    resume_grace_seconds: float = Field(default=30.0, gt=0, le=3600)
    """A "resumable" stream whose client left runs on this long, for GET /v1/streams/<id>."""
    resume_max_streams: int = Field(default=1024, ge=1)
    """Resumable streams held at once; more: 429."""
    slow_client_seconds: float = Field(default=10.0, gt=0)
    """A stream whose client is behind is paused (KV kept) until it reads; reading nothing this long: cut."""
    stream_send_buffer_bytes: int = Field(default=65536, ge=0)
    """A stream socket's SO_SNDBUF; 0: the OS's."""
    drain_seconds: float = Field(default=30.0, ge=0)
    """On SIGTERM, in-flight requests may finish this long."""
    body_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    """A body still arriving this long after its handler asked for it: 408."""
    idle_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    """An idle keep-alive connection, or a request head still arriving, this long: closed."""
    probe_interval_seconds: float = Field(default=60.0, ge=0)
    """Seconds between idle inference probes (a fixed greedy answer checked); 0: at start-up only."""
    models_max: int | None = Field(default=None, ge=1)
    """Unpinned models loaded at once; loading another unloads the least recently used idle one. Unset: no limit."""
    model_load_wait_seconds: float = Field(default=120.0, gt=0)
    """A request for a model that is loading, waking or waiting for room waits this long, then gets 503."""
    liveness_seconds: float = Field(default=60.0, gt=0)
    """/health fails if the engine has work but has taken no step this long."""
    log_format: Literal["text", "json"] = "text"
    """Log lines as text, or one JSON object per line."""
    log_prompts: bool = False
    """Put prompt text in the access log's lines (one per request)."""
    admin_key_sha256: tuple[str, ...] = ()
    """SHA-256 hex digests of the admin keys: /admin/* needs one of them (as does /v1/status with
    status_admin_only); tenant keys never open them."""
    status_admin_only: bool = False
    """/v1/status for the admin keys only (else each tenant sees its own part)."""
    unsupported_tools: Literal["reject", "drop"] = "reject"
    """Tools of a type a protocol does not run (Codex's web_search, Anthropic's server tools): a 400
    naming them ("reject"), or left out and named in the x-inferd-dropped-tools header ("drop")."""

    @field_validator("admin_key_sha256")
    @classmethod
    def _admin_digests(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return digests(value)


class TenantSettings(Section):
    """One tenant: its keys (as digests), rate limits, fair-share weight and what it may use."""

    key_sha256: tuple[str, ...] = ()
    """SHA-256 hex digests of its API keys."""
    requests_per_second: float | None = Field(default=None, gt=0)
    """Its request rate limit; unset: none."""
    requests_burst: int | None = Field(default=None, ge=1)
    """Requests it may send at once; unset: the rate, rounded up."""
    tokens_per_second: float | None = Field(default=None, gt=0)
    """Its token rate limit (prompt + completion tokens); unset: none."""
    tokens_burst: int | None = Field(default=None, ge=1)
    """Tokens it may spend at once; unset: the rate, rounded up."""
    weight: float = Field(default=1.0, gt=0, le=1000)
    """Its share inside a class, against the other tenants'."""
    classes: tuple[str, ...] | None = None
    """The priority classes it may use; unset: all."""
    default_class: str | None = None
    """For its requests that name no priority; unset: the server's."""
    models: tuple[str, ...] | None = None
    """The models (or routes) it may use; unset: all."""
    tier: str = "default"
    """A label routes and degradation rules select on (free, paid, ...)."""
    cache_group: str | None = Field(default=None, min_length=1, max_length=64)
    """Tenants naming the same group share prefix-cache blocks (a public system prompt, say); unset:
    its cached prefixes are its own (another tenant's TTFT cannot tell what it asked)."""
    speculative_history: bool = False
    """Speculation also drafts from this tenant's own recent outputs ([speculative] history_tokens
    of them), never from another tenant's."""

    @field_validator("key_sha256")
    @classmethod
    def _key_digests(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return digests(value)

    @model_validator(mode="after")
    def _bursts_need_rates(self) -> TenantSettings:
        for kind in ("requests", "tokens"):
            if getattr(self, f"{kind}_burst") is not None and getattr(self, f"{kind}_per_second") is None:
                raise ValueError(f"{kind}_burst needs {kind}_per_second")
        if self.classes is not None and self.default_class is not None and self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of its classes {list(self.classes)}")
        return self


class ResponsesSettings(Section):
    """The Responses API's store (api/responses/store.py): what `store: true` keeps, for
    `previous_response_id`, retrieval and background responses; bounded per tenant (else per
    key; on an open server, for everyone together) by count, by bytes and in time."""

    store_by_default: bool = True
    """A request that names no `store` (the openai client sends none) is kept."""
    max_per_tenant: int = Field(default=1024, ge=1)
    """Responses kept per tenant; past it the oldest finished ones go."""
    max_bytes_per_tenant: int = Field(default=64 * 2**20, ge=1, json_schema_extra=SIZE)
    """Their JSON text and events, all told, bytes like "64MiB"."""
    ttl_seconds: float = Field(default=3600.0, gt=0, le=30 * 86400)
    """Kept this long after they start."""

    @field_validator("max_bytes_per_tenant", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return int(parse_memory(value)) if isinstance(value, str) else value


class OutputFilterSettings(Section):
    """A blocklist over the generated text (engine/output/blocklist.py)."""

    blocklist_file: str | None = None
    """One term per line ('#' comments), `re:PATTERN` a regex; read once at start-up; unset: no filter."""
    action: Literal["mask", "stop"] = "mask"
    """"*" over a blocked term, or end the answer with finish_reason "content_filter"."""


REDACT = {  # tag -> regex, applied in this order (a key's or an address's digits are gone before "number")
    "email": r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,8}\.[A-Za-z]{2,24}",
    "api_key": r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{8,}|\b(?:ghp|gho|ghs|xox[abprs])[_-][A-Za-z0-9_-]{10,}"
               r"|\bAKIA[0-9A-Z]{16}\b",
    "ipv4": r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b",
    "number": r"\+?\d(?:[ ().-]{0,2}\d){6,}",  # phone, card, account: 7+ digits, maybe separated
}


class RequestLogSettings(Section):
    """The request file (one JSON line per finished generation request, with its texts) and the
    drift statistics fed from it. Not the access log (one line per request: [server] log_prompts)."""

    path: str | None = None
    """Where the request file is written; unset: off."""
    max_bytes: int = Field(default=64 * 2**20, ge=1, json_schema_extra=SIZE)
    """Rotate the file past this size, bytes like "64MiB"."""
    backups: int = Field(default=5, ge=1)
    """Rotated files kept: path.1 .. path.N."""
    redact: bool = True
    """Replace what redact_patterns match in the texts with [tag]."""
    redact_patterns: dict[str, str] = Field(default_factory=lambda: dict(REDACT))
    """Tag -> regex, applied in order."""
    refusal_phrases: tuple[str, ...] = ("I'm sorry", "I am sorry", "I cannot", "I can't help", "I can't assist",
                                        "I am unable to", "I'm unable to", "As an AI")
    """A choice whose text holds one of these counts as a refusal (drift statistics)."""
    drift_window_seconds: float = Field(default=300.0, gt=0)
    """The window of recent requests compared against the baseline."""
    baseline_requests: int = Field(default=200, ge=1)
    """The first this many requests are the baseline."""

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return int(parse_memory(value)) if isinstance(value, str) else value

    @field_validator("redact_patterns")
    @classmethod
    def _patterns(cls, value: dict[str, str]) -> dict[str, str]:
        for tag, pattern in value.items():
            if not re.fullmatch(r"[a-z0-9_]+", tag):
                raise ValueError(f"tag {tag!r}: lower-case letters, digits and '_' only")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{tag}: invalid regex ({e})") from None
        return value
