"""The OpenAI protocol's endpoints, and GET /v1/models (every served name, as OpenAI lists models).

    POST /v1/completions       completions.py        POST /tokenize        tokenize.py
    POST /v1/chat/completions  chat.py               POST /detokenize      tokenize.py
    GET  /v1/models[/{model}]  here                  GET  /tokenizer_info  tokenize.py
    POST /v1/embeddings        embeddings.py         POST /v1/rerank, /v1/score  embeddings.py
"""

from __future__ import annotations

from aiohttp import web

from inferd.api.errors import APIError
from inferd.api.openai import wire as p
from inferd.api.openai.chat import create_chat_completion
from inferd.api.openai.completions import create_completion
from inferd.api.openai.embeddings import create_embeddings, create_rerank, create_score
from inferd.api.openai.tokenize import detokenize, tokenize, tokenizer_info
from inferd.api.routing.registry import REGISTRY
from inferd.api.wire import dump

_STARTED = 0  # ModelCard.created: fixed, as nothing here knows when the weights were made


def model_cards(request: web.Request) -> list[p.ModelCard]:
    """Every served name: models (with their revision and state, loaded or not), aliases, routes.
    A model never loaded yet has no max_model_len to show."""
    registry = request.app[REGISTRY]
    cards = []
    for slot in registry.slots.values():
        spec, limits = slot.latest_spec, slot.limits
        experts, active = (limits.experts if limits else None) or (None, None)
        life = dict(state=str(slot.life.state), load=spec.load, pinned=slot.pinned,
                    max_model_len=limits.max_model_len if limits else None, revision=spec.revision)
        cards.append(p.ModelCard(id=slot.name, created=_STARTED, experts=experts, active_experts=active, **life))
        cards += [p.ModelCard(id=alias, created=_STARTED, alias_of=slot.name, **life) for alias in spec.aliases]
    cards += [p.ModelCard(id=name, created=_STARTED, route=route.shares()) for name, route in registry.routes.items()]
    return cards


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(dump(p.ModelList(data=model_cards(request))))


async def retrieve_model(request: web.Request) -> web.Response:
    """One served name's card (the openai client's models.retrieve); 404 model_not_found."""
    name = request.match_info["model"]
    card = next((c for c in model_cards(request) if c.id == name), None)
    if card is None:
        raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
    return web.json_response(dump(card))


def add_openai_endpoints(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/embeddings", create_embeddings)
    app.router.add_post("/v1/rerank", create_rerank)
    app.router.add_post("/v1/score", create_score)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
