"""Anthropic's Messages API: a second protocol front-end over the shared generation path.

    wire.py       the request and reply models (pydantic: validated once, here)
    messages.py   POST /v1/messages (whole, or named stream events) and /v1/messages/count_tokens
    cache.py      cache_control as a session (its key and TTL), and the volatile blocks dropped
    errors.py     errors in Anthropic's shape and status codes (429, 529 overloaded, 504 timeout)
    endpoints.py  its endpoints, and its error shape registered for them

It keeps the contract of pipeline/__init__.py (an `Ask` and a `Shape`, then
`pipeline.generate.generate`) and renders through conversation/ (the chat template, the tool-call
format and its grammar), as the OpenAI front-end does; it imports no other protocol package.
Authentication takes Anthropic's `x-api-key` beside `Authorization: Bearer` (gateway/keys.py);
`anthropic-version` and `anthropic-beta` headers are accepted and not read.
"""
