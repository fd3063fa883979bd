"""Versioned hot reload: a new revision loads beside the old one and takes over only once it
has proved itself; the old one drains and is freed.

    POST /admin/models/NAME/reload  {"path"?, "revision"?}   (admin key; SIGHUP: every model
    POST /admin/models/NAME/rollback                          whose table changed)

    load (worker thread) -> start its engine -> inference probe -> evaluation set (eval_file)
        any step fails: the new revision is stopped and dropped, the old keeps serving,
                        422 revision_rejected with the reason (and the log)
        all pass:       slot.current = new (new requests go there at once), slot.previous =
                        the old spec (for a rollback), the old revision retires: its in-flight
                        requests finish on it, then its engine stops and its memory goes

No request is lost or cut: a request holds the revision it was admitted to until it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from inferd.api.body import read_json
from inferd.api.errors import APIError, bad_request
from inferd.api.fleet import FLEET, Fleet, ModelSlot, ModelSpec, Served
from inferd.api.state import STATE, ServerState
from inferd.engine.protocol import EngineRequest
from inferd.model.sampling_params import SamplingParams

log = logging.getLogger(__name__)

EVAL_EXTRA_TOKENS = 2  # generated beyond the expected text's own tokens (tokenization may differ)
PROBE_SECONDS = 60.0  # a new revision whose start-up probe has not run by then is rejected


class ReloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # a new file or folder; None: the current one, read again
    revision: str | None = None  # None: the current revision's name


class RevisionRejected(Exception):
    """The new revision failed to load, its probe or its evaluation set."""


async def reload_model(fleet: Fleet, server: ServerState, slot: ModelSlot, spec: ModelSpec) -> Served:
    """Load `spec` beside the slot's current revision, prove it, and swap it in (module docstring)."""
    if fleet.loader is None:
        raise RevisionRejected("this server was built around one given engine and cannot load another")
    async with slot.lock:
        loop = asyncio.get_running_loop()
        try:
            engine = await loop.run_in_executor(None, fleet.loader, spec)
        except Exception as e:  # (ModelLoadError, OSError, a torch error, out of memory: all the same here)
            raise _rejected(slot, spec, f"it did not load: {e}") from None
        old = slot.current
        new = Served(spec, engine, server, old.probe.interval)
        try:
            await new.start()
            await new.first_probe(within=PROBE_SECONDS)
            failure = await evaluate(new, spec.eval_file)
        except TimeoutError as e:
            await new.stop()
            raise _rejected(slot, spec, str(e)) from None
        except BaseException:
            await new.stop()
            raise
        if failure is not None:
            await new.stop()
            raise _rejected(slot, spec, failure)
        slot.previous, slot.current = old.spec, new
        slot.counts.reloads += 1
        fleet.refresh_aliases()
        slot.retire(old)
        log.info("model %s: revision %s serves (was %s)", slot.name, spec.revision, old.spec.revision)
        return new


def _rejected(slot: ModelSlot, spec: ModelSpec, reason: str) -> RevisionRejected:
    slot.counts.reloads_refused += 1
    message = f"model {slot.name}: revision {spec.revision} rejected, {slot.current.spec.revision} keeps serving: {reason}"
    log.error("%s", message)
    return RevisionRejected(message)


def read_eval_set(path: str) -> list[tuple[str, str]]:
    """(prompt, expected greedy continuation) pairs from a JSON-lines file."""
    cases = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                case = json.loads(line)
                cases.append((str(case["prompt"]), str(case["expected"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: not a JSON object with prompt and expected") from None
    return cases


async def evaluate(served: Served, eval_file: str | None) -> str | None:
    """The first case whose greedy continuation does not start with the expected text, as a
    reason; None when every case passes (or there is no evaluation set)."""
    if eval_file is None:
        return None
    try:
        cases = read_eval_set(eval_file)
    except (OSError, ValueError) as e:
        return f"evaluation set unreadable: {e}"
    engine = served.engine
    answers = await asyncio.gather(*(_greedy(served, prompt, expected) for prompt, expected in cases))
    for (prompt, expected), answer in zip(cases, answers):
        if not answer.startswith(expected):
            return f"evaluation set: {prompt!r} continued as {answer!r}, expected {expected!r}"
    log.info("evaluation set: %d cases pass on %s", len(cases), engine.limits.model_path)
    return None


async def _greedy(served: Served, prompt: str, expected: str) -> str:
    engine = served.engine
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=len(tokenizer.encode(expected)) + EVAL_EXTRA_TOKENS, temperature=0.0)
    # NOTE: past the door on purpose, like the probe: the revision serves nobody yet
    stream = engine.submit(EngineRequest(engine.new_group_id(), tokenizer.encode(prompt), params,
                                         engine.limits.policy.default_class))
    texts = []
    try:
        async for out in stream:
            texts.append(out.text)
    finally:
        stream.abort()
    return "".join(texts)


# ------------------------------------------------------------------------------- endpoints


def _slot(request: web.Request) -> ModelSlot:
    name = request.match_info["name"]
    fleet = request.app[FLEET]
    slot = fleet.slots.get(name)
    if slot is None:
        raise APIError(404, f"no model {name!r} to reload; the models are {list(fleet.slots)}", param="name",
                       code="model_not_found")
    return slot


def _revision(served: Served, reloaded: bool) -> dict[str, Any]:
    spec = served.spec
    return {"model": spec.name, "revision": spec.revision, "path": served.engine.limits.model_path,
            "reloaded": reloaded}


async def reload_endpoint(request: web.Request) -> web.Response:
    slot = _slot(request)
    raw = await read_json(request) if request.can_read_body else {}
    try:
        body = ReloadBody.model_validate(raw)
    except ValueError as e:
        raise bad_request(f"invalid reload body: {e}") from None
    current = slot.current.spec
    spec = dataclasses.replace(current, path=body.path or current.path, revision=body.revision or current.revision)
    return await _swap(request, slot, spec)


async def rollback_endpoint(request: web.Request) -> web.Response:
    slot = _slot(request)
    if slot.previous is None:
        raise APIError(409, f"model {slot.name} has no previous revision to return to", code="no_previous_revision")
    return await _swap(request, slot, slot.previous)


async def _swap(request: web.Request, slot: ModelSlot, spec: ModelSpec) -> web.Response:
    try:
        served = await reload_model(request.app[FLEET], request.app[STATE], slot, spec)
    except RevisionRejected as e:
        raise APIError(422, str(e), code="revision_rejected") from None
    return web.json_response(_revision(served, True))


async def reload_changed(fleet: Fleet, server: ServerState, specs: list[ModelSpec]) -> list[str]:
    """SIGHUP: reload every model whose table changed; what happened to each, for the log."""
    done = []
    for spec in specs:
        slot = fleet.slots.get(spec.name) or (fleet.primary if not spec.name else None)  # ("": the one model)
        if slot is None:
            continue  # (models are added or removed by a restart)
        spec = dataclasses.replace(spec, name=slot.name)
        if spec == slot.current.spec:
            continue
        try:
            await reload_model(fleet, server, slot, spec)
            done.append(f"{spec.label} serves")
        except RevisionRejected as e:
            done.append(str(e))
    return done


def add_reload_routes(app: web.Application) -> None:
    app.router.add_post("/admin/models/{name}/reload", reload_endpoint)
    app.router.add_post("/admin/models/{name}/rollback", rollback_endpoint)
