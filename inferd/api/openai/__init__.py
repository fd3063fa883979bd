"""The OpenAI protocol: one front-end over the shared generation path.

    wire.py, chat_wire.py  the request and reply models (pydantic: validated once, here)
    completions.py         POST /v1/completions: prompts in, a text_completion out
    chat.py                POST /v1/chat/completions: messages through the chat template
    ask.py                 a body as the pipeline's `Ask` (sampling, limits asked, timeouts)
    structured.py, tools.py  response_format and tool_choice as grammars; tool calls parsed
    logprobs.py, events.py   logprobs and streamed chunks in OpenAI's shapes
    tokenize.py            POST /tokenize, /detokenize (vLLM's shapes)
    endpoints.py           its endpoints, and GET /v1/models

The contract a protocol front-end keeps (pipeline/__init__.py): parse the body, build an `Ask`
and a `Shape`, call `pipeline.generate.generate`. It writes no gateway, routing, admission or
streaming code; a second protocol (Anthropic's Messages, OpenAI's Responses) is a sibling
package of this one.
"""
