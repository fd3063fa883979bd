"""The one pooling path (embeddings, rerank, score) every pooling endpoint shares: generation's
path (generate.py) without sampling.

    authorize (class: the request's priority, else the policy's pooling class) -> choose the model
    (names, aliases, routes, fallbacks) -> the model's task -> inputs as token ids (a worker thread
    for a big body) -> the door (each input's length, the class's room) -> charge the tenant ->
    admit and submit together -> each input's final output -> the record and the counts

Each input (a text, or a (query, document) pair) is one prompt-only engine request, all submitted
together so that the scheduler packs them into the same steps; `Generation`'s `with` block aborts
every input still running once one fails or the client leaves, so no request outlives its HTTP
request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from inferd.api.admission.ask import Ask
from inferd.api.errors import bad_request, timeout_error
from inferd.api.gateway.gate import GATEWAY
from inferd.api.gateway.keys import principal_of
from inferd.api.gateway.tenants import Tenant
from inferd.api.pipeline.generate import ANSWERED_BY, FALLBACK_FROM, request_record
from inferd.api.pipeline.prompts import make_prompts
from inferd.api.routing.holds import acquire
from inferd.api.routing.routes import Caller
from inferd.api.state import SETTINGS
from inferd.api.streaming.generation import POLL_SECONDS, Generation, client_gone, ending_error
from inferd.api.streaming.sse import OutputQueue
from inferd.engine.protocol import EngineLimits, EngineOutput, PoolingParams
from inferd.settings.policy import SchedulingPolicy
from inferd.text.tokenizer import Tokenizer

Prompts = tuple[list[list[int]], PoolingParams]  # each input's token ids, and what the engine makes of them
# for the chosen model (its name, limits and tokenizer): its Prompts (off the loop for a big body)
Prepare = Callable[[str, EngineLimits, Tokenizer], Prompts]


@dataclass(frozen=True)
class PoolingJob:
    """One pooling request as the shared run below takes it (plain data and two callables)."""

    task: str  # "embed" or "score"
    model: str  # a model, an alias or a route
    priority: str | int | None
    user: str | None
    inputs: int  # texts or pairs: each one engine request
    param: str  # the field an error about the inputs names
    id_prefix: str
    prepare: Prepare
    prompt_text: Callable[[], str]  # for the log line and the request file


@dataclass(frozen=True)
class Pooled:
    """A pooling request's answer: who answered, and each input's final output in input order."""

    id: str
    created: int
    model: str
    limits: EngineLimits
    outputs: list[EngineOutput]
    prompt_tokens: int



class PoolingRun(Generation):
    """The engine requests of one pooling request: admitted and submitted together on entry,
    every unfinished one aborted on exit (Generation's contract)."""

    async def finals(self, request: web.Request) -> list[EngineOutput] | None:
        """Each input's final output, in input order; None if the client left. An input aborted,
        failed or timed out is the whole request's error (the rest are aborted on exit)."""
        finals: list[EngineOutput | None] = [None] * len(self.prompts)
        outputs = OutputQueue(self.streams)
        try:
            while not outputs.done:
                batch = await outputs.next_batch(POLL_SECONDS)
                if client_gone(request):
                    return None
                for prompt, out in batch:
                    self.note(out)
                    if out.finish_reason in ("abort", "error"):
                        raise ending_error(out)
                    if out.finish_reason == "timeout":
                        raise timeout_error(out)
                    if out.finished:
                        finals[prompt] = out
        finally:
            outputs.close()
        return [out for out in finals if out is not None]


async def run_pooling(request: web.Request, job: PoolingJob) -> Pooled | None:
    """The whole of a pooling request (the module's docstring has the stages); None if the client left."""
    app, principal = request.app, principal_of(request)
    gateway, tenant = app[GATEWAY], principal.tenant
    cls = gateway.authorize(principal, job.model, pooling_priority(gateway.policy, tenant, job.priority))
    caller = Caller(cls.name, job.user, tenant.name if tenant else None, tenant.tier if tenant else None)
    choice = await acquire(request, job.model, caller)
    if choice.cascade is not None:
        raise bad_request(f"{job.model!r} is a cascade route, which only generates: name a model", param="model",
                          code="wrong_task")
    served, name = choice.served, choice.slot.name
    limits = served.engine.limits
    check_task(name, limits, job.task)
    max_prompts = app[SETTINGS].limits.max_prompts
    if job.inputs > max_prompts:
        raise bad_request(f"at most {max_prompts} inputs per request, got {job.inputs}", param=job.param)
    prompts, pooling = await make_prompts(request, served.engine.tokenizer, limits.max_model_len,
                                          lambda tokenizer: job.prepare(name, limits, tokenizer))
    ask = Ask(model=job.model, priority=job.priority, user=job.user, prompt_param=job.param, pooling=pooling)
    prepared = await served.door.prepare(ask, prompts, cls, tenant=tenant)
    ticket = gateway.charge(principal, prepared.cost)  # (prompts + 1 each; the unused token is refunded)
    record = request_record(request, job.user, job.prompt_text)
    if record is not None:
        record.model, record.revision, record.task = served.spec.name, served.spec.revision, job.task
    request[ANSWERED_BY] = served.spec.label
    if choice.fallback_from is not None:
        request[FALLBACK_FROM] = choice.fallback_from
    with PoolingRun(served.door, prepared, job.id_prefix, record, ticket) as run:
        outputs = await run.finals(request)
    if outputs is None:
        return None
    choice.slot.counts.pooling[job.task].add(len(prompts), prepared.prompt_tokens)
    return Pooled(run.id, run.created, name, limits, outputs, prepared.prompt_tokens)


def pooling_priority(policy: SchedulingPolicy, tenant: Tenant | None, asked: str | int | None) -> str | int | None:
    """The class a pooling request names, else the policy's pooling class, unless its tenant may
    not use that one (then the tenant's default: the gateway's choice for a request naming none)."""
    if asked is not None:
        return asked
    pooling = policy.pooling_default
    if tenant is not None and tenant.classes is not None and pooling not in tenant.classes:
        return None
    return pooling


def check_task(model: str, limits: EngineLimits, task: str) -> None:
    """A 400 naming what the model serves when it does not answer `task`."""
    if task == "embed" and limits.pooler is None:
        why = ("it scores (task \"score\"): ask /v1/rerank or /v1/score" if limits.task == "score"
               else "its embeddings are off ([model] embeddings = false)")
        raise bad_request(f"the model {model!r} answers no embeddings: {why}", param="model", code="wrong_task")
    if task == "score" and limits.task != "score":
        raise bad_request(f"the model {model!r} serves task {limits.task!r}: /v1/rerank and /v1/score need a "
                          "reranker (task \"score\")", param="model", code="wrong_task")


