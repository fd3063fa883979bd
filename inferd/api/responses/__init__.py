"""OpenAI's Responses API (what Codex and the Agents SDK speak): a protocol front-end over the
shared generation path, with a bounded store of responses.

    wire.py     the request (input items, function tools, text.format, reasoning) and the reply
    create.py   POST /v1/responses: whole, or the numbered event sequence; its route; a stored
                conversation continued (previous_response_id), a response kept, or run in the
                background
    events.py   a streamed response's numbered events
    store.py    the store: per tenant, bounded by count, bytes and time to live (pure, its clock injected)
    stored.py   the store in the app: GET / DELETE /v1/responses/{id}, /cancel, a background
                response's events replayed and followed (streaming/resume.py's EventLog), /metrics

It keeps the contract of pipeline/__init__.py and renders through conversation/, as the other
protocol packages do, and imports none of them. Its errors are OpenAI's shape (the default).
"""
