"""Settings: inferd.toml, then INFERD_* environment variables, then command-line flags.

Everything is validated here, once; an invalid value names its key and what is allowed.
Environment variables are `INFERD_<SECTION>_<KEY>` in upper case, e.g. `INFERD_MODEL_DTYPE`.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from inferd.settings.policy import DEFAULT_CLASSES, PriorityClass, SchedulingPolicy, ShedConfig, Timeouts
from inferd.settings.models import DegradationSettings, ModelTable, RouteTable, check_models
from inferd.settings.values import DIGEST_HINT, SHA256_HEX, SettingsError, parse_memory

class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSettings(_Section):
    path: str | None = None  # GGUF file or Hugging Face folder; None: the embedded SmolLM2
    name: str | None = None  # the name clients use; None: derived from the path
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(default=None, ge=16)
    cuda_graphs: bool = True  # CUDA only: replay decode steps from graphs captured at start-up
    # CPU: the linear layers' weights packed (inferd/model/layers/quant.py); auto: as the GGUF stores them
    weights: Literal["auto", "bf16", "int8", "int4"] = "auto"
    # CPU: every request's tokens the same whatever runs beside it (batch-invariant kernels)
    deterministic: bool = True  # (bfloat16; float32 runs its plain path)


class CacheSettings(_Section):
    block_size: int = Field(default=16, ge=1, le=128)
    kv_cache_memory: float | None = None  # None ("auto"): 2 GiB on the host, most of the free memory on CUDA
    prefix_caching: bool = True
    swap_space: float = 2**30  # host memory for swapped-out blocks (scheduler.preemption_mode "swap")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two in [1, 128]")
        return value

    @field_validator("kv_cache_memory", "swap_space", mode="before")
    @classmethod
    def _memory(cls, value: Any, info: ValidationInfo) -> float | None:
        if info.field_name == "kv_cache_memory" and (value is None or value == "auto"):
            return None
        return parse_memory(value)


class SchedulerSettings(_Section):
    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=512, ge=16, le=1 << 20)
    default_class: str = SchedulingPolicy().default_class
    aging_seconds: float = Field(default=SchedulingPolicy().aging_seconds, ge=0)
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # inside a class: "vtc" serves the backlogged tenant with the fewest tokens served per
    # weight first; "fcfs" serves by arrival (and deadline) alone
    fairness: Literal["vtc", "fcfs"] = "vtc"


_SHED = ShedConfig()  # the defaults


class SheddingSettings(_Section):
    enabled: bool = _SHED.enabled
    margin: float = Field(default=_SHED.margin, ge=0, lt=1)
    window_seconds: float = Field(default=_SHED.window_seconds, gt=0)
    min_samples: int = Field(default=_SHED.min_samples, ge=1)
    escalate_seconds: float = Field(default=_SHED.escalate_seconds, ge=0)
    recover_seconds: float = Field(default=_SHED.recover_seconds, ge=0)
    max_running: int = Field(default=_SHED.max_running, ge=0)
    max_tokens: int = Field(default=_SHED.max_tokens, ge=1)


class ClassSettings(_Section):
    """One priority class; timeouts in seconds, 0 meaning none."""

    priority: int = Field(ge=0, le=1000)
    max_waiting: int = Field(default=256, ge=1)
    max_queued_tokens: int = Field(default=65536, ge=1)
    ttft_target: float = Field(default=2.0, gt=0)
    tpot_target: float = Field(default=0.5, gt=0)
    queue_timeout: float = Field(default=0.0, ge=0)
    ttft_timeout: float = Field(default=0.0, ge=0)
    token_timeout: float = Field(default=0.0, ge=0)
    total_timeout: float = Field(default=0.0, ge=0)
    max_tokens: int = Field(default=4096, ge=1)
    kv_reserve: float = Field(default=0.0, ge=0, lt=1)
    sheddable: bool = False

    def priority_class(self, name: str) -> PriorityClass:
        def limit(seconds: float) -> float | None:
            return seconds or None

        return PriorityClass(
            name=name, priority=self.priority, max_waiting=self.max_waiting, max_queued_tokens=self.max_queued_tokens,
            ttft_target=self.ttft_target, tpot_target=self.tpot_target,
            timeouts=Timeouts(limit(self.queue_timeout), limit(self.ttft_timeout), limit(self.token_timeout),
                              limit(self.total_timeout)),
            max_tokens=self.max_tokens, kv_reserve=self.kv_reserve, sheddable=self.sheddable,
        )


def _class_table(c: PriorityClass) -> dict[str, Any]:
    """A built-in class as the keys of a [classes.NAME] table."""
    t = c.timeouts
    return {"priority": c.priority, "max_waiting": c.max_waiting, "max_queued_tokens": c.max_queued_tokens,
            "ttft_target": c.ttft_target, "tpot_target": c.tpot_target, "queue_timeout": t.queue or 0.0,
            "ttft_timeout": t.ttft or 0.0, "token_timeout": t.token or 0.0, "total_timeout": t.total or 0.0,
            "max_tokens": c.max_tokens, "kv_reserve": c.kv_reserve, "sheddable": c.sheddable}


_BUILTIN_CLASSES = {c.name: _class_table(c) for c in DEFAULT_CLASSES}


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    # SHA-256 hex digests of the accepted API keys, one per line ('#' comments allowed); keys
    # also come from --api-key and INFERD_API_KEYS (comma-separated, in the clear)
    api_keys_file: str | None = None
    open_paths: tuple[str, ...] = ("/health", "/ready", "/metrics")  # served without a key
    keepalive_seconds: float = Field(default=10.0, gt=0, le=300)  # SSE comment while queued
    # a "resumable" stream whose client left runs on this long, for GET /v1/streams/<id> (resume.py)
    resume_grace_seconds: float = Field(default=30.0, gt=0, le=3600)
    resume_max_streams: int = Field(default=1024, ge=1)  # resumable streams held at once; more: 429
    # a stream whose client is behind is paused (KV kept) until it reads; reading nothing this long: cut
    slow_client_seconds: float = Field(default=10.0, gt=0)
    stream_send_buffer_bytes: int = Field(default=65536, ge=0)  # a stream socket's SO_SNDBUF; 0: the OS's
    drain_seconds: float = Field(default=30.0, ge=0)  # SIGTERM: in-flight requests may finish this long
    # the edge (api/edge.py): a body still arriving this long after its handler asked: 408; an
    # idle keep-alive connection, or a request head still arriving, this long: closed (nginx: 60 s)
    body_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    idle_timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    probe_interval_seconds: float = Field(default=60.0, ge=0)  # re-run the inference probe when idle; 0: start-up only
    liveness_seconds: float = Field(default=60.0, gt=0)  # /health fails if the engine has work but no step this long
    log_format: Literal["text", "json"] = "text"
    log_prompts: bool = False  # put prompt text in the request log lines
    # SHA-256 hex digests of the admin keys: /admin/* needs one of them (as does /v1/status
    # with status_admin_only); tenant keys never open them
    admin_key_sha256: tuple[str, ...] = ()
    status_admin_only: bool = False
    # tools of a type a protocol does not run (Codex's web_search, Anthropic's server tools): a 400
    # naming them ("reject"), or left out and named in the x-inferd-dropped-tools header ("drop"),
    # for clients that always send them
    unsupported_tools: Literal["reject", "drop"] = "reject"

    @field_validator("admin_key_sha256")
    @classmethod
    def _admin_digests(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _digests(value)


_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _digests(values: tuple[str, ...]) -> tuple[str, ...]:
    for number, value in enumerate(values):
        if not SHA256_HEX.fullmatch(value):
            # NOTE: the value is not echoed: it may be a key pasted in the clear
            raise ValueError(f"entry {number} is not a SHA-256 hex digest ({DIGEST_HINT})")
    return tuple(v.lower() for v in values)


class TenantSettings(_Section):
    """One tenant: its keys (as digests), rate limits, fair-share weight and what it may use."""

    key_sha256: tuple[str, ...] = ()
    requests_per_second: float | None = Field(default=None, gt=0)
    requests_burst: int | None = Field(default=None, ge=1)  # default: the rate, rounded up
    tokens_per_second: float | None = Field(default=None, gt=0)  # prompt + completion tokens
    tokens_burst: int | None = Field(default=None, ge=1)
    weight: float = Field(default=1.0, gt=0, le=1000)  # its share inside a class, against the others'
    classes: tuple[str, ...] | None = None  # the priority classes it may use; None: all
    default_class: str | None = None  # for its requests that name no priority; None: the server's
    models: tuple[str, ...] | None = None  # the models (or routes) it may use; None: all
    tier: str = "default"  # a label routes and degradation rules select on (e.g. free, paid)
    # tenants naming the same group share prefix-cache blocks (a public system prompt, say);
    # None: its cached prefixes are its own (another tenant's TTFT cannot tell what it asked)
    cache_group: str | None = Field(default=None, min_length=1, max_length=64)

    @field_validator("key_sha256")
    @classmethod
    def _key_digests(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return _digests(value)

    @model_validator(mode="after")
    def _bursts_need_rates(self) -> TenantSettings:
        for kind in ("requests", "tokens"):
            if getattr(self, f"{kind}_burst") is not None and getattr(self, f"{kind}_per_second") is None:
                raise ValueError(f"{kind}_burst needs {kind}_per_second")
        if self.classes is not None and self.default_class is not None and self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of its classes {list(self.classes)}")
        return self


class ResponsesSettings(_Section):
    """The Responses API's store (api/responses/store.py): what `store: true` keeps, for
    `previous_response_id`, retrieval and background responses; bounded per tenant (else per
    key; on an open server, for everyone together) by count, by bytes and in time."""

    store_by_default: bool = True  # a request that names no `store` (the openai client sends none): kept
    max_per_tenant: int = Field(default=1024, ge=1)  # responses kept; past it the oldest finished go
    max_bytes_per_tenant: int = Field(default=64 * 2**20, ge=1)  # their JSON text and events, all told
    ttl_seconds: float = Field(default=3600.0, gt=0, le=30 * 86400)  # kept this long after they start

    @field_validator("max_bytes_per_tenant", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return int(parse_memory(value)) if isinstance(value, str) else value


class LimitSettings(_Section):
    max_tokens_default: int = Field(default=256, ge=1)  # when a request names no max_tokens
    max_tokens_limit: int = Field(default=4096, ge=1)  # a request asking more gets a 400
    max_n: int = Field(default=8, ge=1, le=128)  # choices per request
    max_prompts: int = Field(default=64, ge=1)  # prompts in one batched /v1/completions request


class HealthSettings(_Section):
    # a forward failing in two steps in a row, no more than this apart, makes the engine unhealthy
    failure_window_seconds: float = Field(default=30.0, gt=0)
    recover_seconds: float = Field(default=10.0, ge=0)  # unhealthy: /ready 503 at least this long
    liveness_failures: int = Field(default=5, ge=2)  # this many failed steps in a row: /health 503


class RuntimeSettings(_Section):
    threads: int = Field(default=0, ge=0, le=1024)  # torch CPU threads; 0: one per core


class OutputFilterSettings(_Section):
    # one term per line ('#' comments), `re:PATTERN` a regex; read once at start-up by
    # EngineConfig.from_settings (engine/output/blocklist.py); None: no filter
    blocklist_file: str | None = None
    action: Literal["mask", "stop"] = "mask"  # "*" over a blocked term, or end with "content_filter"


_REDACT = {  # tag -> regex, applied in this order (a key's or an address's digits are gone before "number")
    "email": r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,8}\.[A-Za-z]{2,24}",
    "api_key": r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{8,}|\b(?:ghp|gho|ghs|xox[abprs])[_-][A-Za-z0-9_-]{10,}"
               r"|\bAKIA[0-9A-Z]{16}\b",
    "ipv4": r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b",
    "number": r"\+?\d(?:[ ().-]{0,2}\d){6,}",  # phone, card, account: 7+ digits, maybe separated
}


class RequestLogSettings(_Section):
    """The request file (one JSON line per finished generation) and the drift statistics."""

    path: str | None = None  # None: off
    max_bytes: int = Field(default=64 * 2**20, ge=1)  # rotate the file past this size
    backups: int = Field(default=5, ge=1)  # rotated files kept: path.1 .. path.N
    redact: bool = True
    redact_patterns: dict[str, str] = Field(default_factory=lambda: dict(_REDACT))
    refusal_phrases: tuple[str, ...] = ("I'm sorry", "I am sorry", "I cannot", "I can't help", "I can't assist",
                                        "I am unable to", "I'm unable to", "As an AI")
    drift_window_seconds: float = Field(default=300.0, gt=0)
    baseline_requests: int = Field(default=200, ge=1)

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


class Settings(_Section):
    server: ServerSettings = ServerSettings()
    limits: LimitSettings = LimitSettings()
    model: ModelSettings = ModelSettings()
    cache: CacheSettings = CacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    shedding: SheddingSettings = SheddingSettings()
    # [classes.NAME] tables replace the built-in classes; a table named like a built-in class
    # (interactive, batch) starts from that class's values
    classes: dict[str, ClassSettings] = Field(
        default_factory=lambda: {name: ClassSettings(**t) for name, t in _BUILTIN_CLASSES.items()})
    health: HealthSettings = HealthSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    output_filter: OutputFilterSettings = OutputFilterSettings()
    request_log: RequestLogSettings = RequestLogSettings()  # off unless request_log.path is set
    responses: ResponsesSettings = ResponsesSettings()  # the Responses API's stored responses
    # [tenants.NAME] tables: who may call, at what rate, with what share (api/gateway/tenants.py)
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)
    # [models.NAME] and [routes.NAME] tables: several models in one process (settings/models.py);
    # no [models] table: the one model of [model]
    models: dict[str, ModelTable] = Field(default_factory=dict)
    routes: dict[str, RouteTable] = Field(default_factory=dict)
    degradation: DegradationSettings = DegradationSettings()

    @field_validator("classes", mode="before")
    @classmethod
    def _start_from_builtins(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        if not value:
            raise ValueError("at least one class is needed")
        return {name: {**_BUILTIN_CLASSES.get(name, {}), **table} if isinstance(table, dict) else table
                for name, table in value.items()}

    @model_validator(mode="after")
    def _valid_policy(self) -> Settings:
        self.policy()  # raises ValueError naming what is wrong (duplicate priority, default_class)
        self._check_tenants()
        check_models(self.models, self.routes, set(self.classes))
        unknown = [c for c in self.degradation.classes if c not in self.classes]
        if unknown:
            raise ValueError(f"degradation.classes: unknown classes {unknown}; the classes are {list(self.classes)}")
        return self

    def _check_tenants(self) -> None:
        owners: dict[str, str] = {d: "the admin keys" for d in self.server.admin_key_sha256}
        for name, tenant in self.tenants.items():
            if not _TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: letters, digits, '_', '.', '-', at most 64")
            named = [*(tenant.classes or ()), *([tenant.default_class] if tenant.default_class else [])]
            unknown = [c for c in named if c not in self.classes]
            if unknown:
                raise ValueError(f"tenants.{name}: unknown classes {unknown}; the classes are {list(self.classes)}")
            for d in tenant.key_sha256:
                if d in owners:
                    raise ValueError(f"tenants.{name}: one of its keys is also a key of {owners[d]}")
                owners[d] = f"tenant {name!r}"

    def policy(self) -> SchedulingPolicy:
        sched, shed = self.scheduler, self.shedding
        return SchedulingPolicy(
            classes=tuple(c.priority_class(name) for name, c in self.classes.items()),
            default_class=sched.default_class,
            aging_seconds=sched.aging_seconds,
            preemption_mode=sched.preemption_mode,
            fairness=sched.fairness,
            shedding=ShedConfig(
                enabled=shed.enabled, margin=shed.margin, window_seconds=shed.window_seconds,
                min_samples=shed.min_samples, escalate_seconds=shed.escalate_seconds,
                recover_seconds=shed.recover_seconds, max_running=shed.max_running, max_tokens=shed.max_tokens,
            ),
        )


def load_settings(
    path: str | Path | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Merge the TOML file, the environment and the overrides (flags), then validate once."""
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise SettingsError(f"{path}: cannot read the settings file ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"{path}: invalid TOML ({e})") from None
    environ = os.environ if environ is None else environ
    for section, fields in Settings.model_fields.items():
        if section in ("classes", "tenants", "models", "routes"):
            continue  # tables of tables: the file only
        for key, field in fields.annotation.model_fields.items():  # type: ignore[union-attr]
            value = environ.get(f"INFERD_{section}_{key}".upper())
            if value is not None:
                is_list = getattr(field.annotation, "__origin__", None) is tuple
                data.setdefault(section, {})[key] = [v.strip() for v in value.split(",") if v.strip()] if is_list else value
    for section, values in (overrides or {}).items():
        for key, value in values.items():
            if value is not None:
                data.setdefault(section, {})[key] = value
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise SettingsError("; ".join(_describe(err) for err in e.errors())) from None


def _describe(err: Any) -> str:
    key = ".".join(str(part) for part in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown setting {key!r}"
    if not key:  # a rule across keys (the scheduling policy)
        return f"invalid settings: {err['msg']}"
    if err["type"] == "missing":
        return f"missing setting {key}"
    if "key_sha256" in key:  # NOTE: not echoed: it may be a key pasted in the clear
        return f"invalid setting {key}: {err['msg']}"
    return f"invalid setting {key} = {err.get('input')!r}: {err['msg']}"
