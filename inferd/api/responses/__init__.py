"""OpenAI's Responses API (what Codex and the Agents SDK speak): a protocol front-end over the
shared generation path, stateless for now.

    wire.py     the request (input items, function tools, text.format, reasoning) and the reply
    create.py   POST /v1/responses: whole, or the numbered event sequence; its route

It keeps the contract of pipeline/__init__.py and renders through conversation/, as the other
protocol packages do, and imports none of them. Its errors are OpenAI's shape (the default).
Not yet: stored responses (previous_response_id, retrieve, cancel, replay), background ones.
"""
