"""The conversation as every chat protocol renders it, whatever its wire format.

    render.py   messages (the dicts chat templates read) and tools -> the model's prompt tokens
    tools.py    the Hermes tool-call text format for templates without tools: the system prompt
                that teaches it, earlier calls as text, the parser (a repeated call dropped)
    tool_formats.py  which tool-call format the model's template speaks (Hermes, Llama-3's JSON),
                and its parser
    tool_grammar.py  the grammars that hold calls to the declared functions: only calls
                ("required", a named function), or free text whose calls are held ("auto")
    reasoning.py  a thinking model's answer split into reasoning and content, streamed or whole

A protocol front-end (openai/, anthropic/) turns its own messages into template dicts (role,
content, tool_calls, tool_call_id, reasoning_content) and its tools into OpenAI-style function dicts, and calls these.
It may import: pipeline and below (shared), the engine's structured grammars; no protocol package.
"""
