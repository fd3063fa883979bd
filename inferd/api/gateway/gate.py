"""The gateway: what a caller may use, its rate limits, and its tenant's accounts, on the event loop.

    authorize: principal -> model allowed? (403) -> its class (400 unknown) allowed? (403)
    charge:    the prepared request's cost -> dual bucket charge (429 / 400) -> a Ticket
    the end:   the Ticket refunds the tokens not generated, counts TTFT / TPOT, tokens in and out

A request is charged its prompt tokens plus max_tokens for every choice when it is admitted,
before any queueing, so a tenant cannot overdraw with long outputs; what it did not generate is
given back when it ends. The gateway is the only writer of the limiters and the per-tenant
accounts; the engine's side of fairness (virtual token counters) is in its snapshot.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from inferd.api.errors import APIError, bad_request
from inferd.api.gateway.ratelimit import Charge, NeverFits, RateLimited, TenantLimiter, retry_after_header
from inferd.api.gateway.tenants import Keyring, Principal, Tenant
from inferd.engine.protocol import RequestMetrics, Samples
from inferd.settings.policy import PriorityClass, SchedulingPolicy

# why a tenant's request was refused: the gateway's own reasons, then the door's (admission/queues.py)
GATEWAY_REASONS = ("rate_limit_requests", "rate_limit_tokens", "too_large", "model_not_allowed",
                   "class_not_allowed")


@dataclass
class TenantAccount:
    """A tenant's counts since start (kept across reloads, so counters never go back)."""

    requests: int = 0  # admitted by the gateway
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejections: Counter[str] = field(default_factory=Counter)  # by reason
    ttft: Samples = field(default_factory=Samples)
    tpot: Samples = field(default_factory=Samples)


class Ticket:
    """One admitted request's account with its tenant: its charge, refunded when it ends."""

    def __init__(self, tenant: Tenant, account: TenantAccount, limiter: TenantLimiter | None,
                 charge: Charge | None) -> None:
        self.tenant = tenant
        self.account = account
        self.limiter = limiter
        self.charge = charge

    def refused(self, reason: str) -> None:
        """The door refused it after the gateway let it through (queue full, draining, ...)."""
        self.account.requests -= 1
        self.account.rejections[reason] += 1

    def finished(self, metrics: RequestMetrics) -> None:
        """One choice ended: its latencies go into the tenant's histograms."""
        if metrics.ttft is None:
            return
        self.account.ttft.add(metrics.ttft)
        if metrics.output_tokens > 1:
            self.account.tpot.add((metrics.e2e - metrics.ttft) / (metrics.output_tokens - 1))

    def close(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The request ended: count its tokens, refund what it was charged and did not use."""
        self.account.prompt_tokens += prompt_tokens
        self.account.completion_tokens += completion_tokens
        if self.limiter is not None and self.charge is not None:
            self.limiter.refund(self.charge, prompt_tokens + completion_tokens)


class Gateway:
    def __init__(self, keyring: Keyring, policy: SchedulingPolicy,
                 reload: Callable[[], Keyring] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._reload = reload
        self._clock = clock
        self.keyring = keyring
        self.limiters: dict[str, TenantLimiter] = {}
        self.accounts: dict[str, TenantAccount] = {}
        self.apply(keyring)

    def apply(self, keyring: Keyring) -> None:
        """Serve with these keys and tenants from now on (a tenant's buckets keep their levels)."""
        classes = {c.name for c in self.policy.classes}
        for tenant in keyring.tenants.values():
            unknown = sorted({*(tenant.classes or ()), *filter(None, [tenant.default_class])} - classes)
            if unknown:  # (the settings check this against the file's classes; these are the running ones)
                raise ValueError(f"tenants.{tenant.name}: unknown classes {unknown}; the classes are {sorted(classes)}")
        limiters = {}
        for name, tenant in keyring.tenants.items():
            limiter = self.limiters.get(name)
            if limiter is None:
                limiter = TenantLimiter(tenant.limits, self._clock)
            else:
                limiter.update(tenant.limits)  # keeps what the tenant has used
            limiters[name] = limiter
            self.accounts.setdefault(name, TenantAccount())
        self.keyring, self.limiters = keyring, limiters

    async def reload(self) -> Keyring:
        """The keys and tenants read again (SIGHUP, POST /admin/reload), off the event loop (file
        reads), then served. A bad file raises SettingsError or ValueError, and nothing changes."""
        if self._reload is None:
            raise ValueError("this server was not started from the command line: nothing to reload")
        keyring = await asyncio.to_thread(self._reload)
        self.apply(keyring)
        return keyring

    # ---------------------------------------------------------------------------- checks

    def authorize(self, principal: Principal, model: str, priority: str | int | None) -> PriorityClass:
        """The request's priority class, once the caller may use the model and the class: its own
        `priority` (a name or number), else its tenant's default, else the policy's default.
        403 for a model or class the tenant may not use, 400 for a class that does not exist."""
        tenant = principal.tenant
        if tenant is not None:
            self._check(tenant, tenant.models, "model", model, "model", "model_not_allowed")
        if priority is None and tenant is not None:
            priority = tenant.default_class
        try:
            cls = self.policy.lookup(priority)
        except KeyError:
            known = ", ".join(f"{c.name!r} ({c.priority})" for c in self.policy.ranked)
            raise bad_request(f"unknown priority {priority!r}; the classes are {known}", param="priority",
                              code="unknown_priority") from None
        if tenant is not None:
            self._check(tenant, tenant.classes, "priority class", cls.name, "priority", "class_not_allowed")
        return cls

    def _check(self, tenant: Tenant, allowed: frozenset[str] | None, what: str, name: str, param: str,
               code: str) -> None:
        """A 403 naming what the tenant may use, unless `name` is in `allowed` (None: anything)."""
        if allowed is None or name in allowed:
            return
        self._refuse(tenant, code)
        raise APIError(403, f"the tenant {tenant.name!r} may not use the {what} {name!r}; it may use {sorted(allowed)}",
                       type="permission_error", param=param, code=code)

    # ---------------------------------------------------------------------------- charge

    def charge(self, principal: Principal, tokens: int) -> Ticket | None:
        """Charge a request of up to `tokens` tokens (prompts + max_tokens for every choice) to
        its tenant's buckets: a Ticket to close when it ends (None: no tenant), else 429 / 400."""
        tenant = principal.tenant
        if tenant is None:
            return None
        limiter, account = self.limiters[tenant.name], self.accounts[tenant.name]
        try:
            charge = limiter.take(tokens)
        except NeverFits as e:
            self._refuse(tenant, "too_large")
            raise bad_request(f"the request needs up to {e.tokens} tokens (prompt + max_tokens for every choice) "
                              f"and the tenant's tokens_burst is {e.capacity}: it can never be admitted; lower "
                              "max_tokens or n", param="max_tokens", code="rate_limit_too_large") from None
        except RateLimited as e:
            self._refuse(tenant, f"rate_limit_{e.kind}")
            raise APIError(429, e.message, type=e.kind, code="rate_limit_exceeded",
                           headers={"Retry-After": retry_after_header(e.retry_after)}) from None
        account.requests += 1
        return Ticket(tenant, account, limiter, charge)

    def _refuse(self, tenant: Tenant, reason: str) -> None:
        self.accounts[tenant.name].rejections[reason] += 1

    def headers(self, principal: Principal) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers of the caller's tenant, as its buckets stand now."""
        tenant = principal.tenant
        if tenant is None:
            return {}
        limiter = self.limiters.get(tenant.name)
        return {} if limiter is None else limiter.headers()


GATEWAY = web.AppKey("gateway", Gateway)
