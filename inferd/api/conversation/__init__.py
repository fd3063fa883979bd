"""The conversation as every chat protocol renders it, whatever its wire format.

    render.py   messages (the dicts chat templates read) and tools -> the model's prompt tokens
    tools.py    the Hermes tool-call text format for templates without tools: the system prompt
                that teaches it, earlier calls as text, the parser (a repeated call dropped)
    tool_formats.py  which tool-call format the model's template speaks (Hermes, Llama-3's JSON, Qwen3.5's XML),
                and its parser
    tool_grammar.py  the grammars that hold calls to the declared functions: only calls
                ("required", a named function), or free text whose calls are held ("auto")
    reasoning.py  a thinking model's answer split into reasoning and content, streamed or whole
    reasoning_grammar.py  a thinking model's grammar (the content's, after the reasoning) and budget
    answer.py   the one answer decoder: a choice's text -> typed parts (parts.py: reasoning, text,
                tool-call start and arguments, finish), whole or streamed, however it is chunked
    harmony.py  gpt-oss's chat format through openai_harmony: the prompt rendered from the
                messages, the answer's token ids parsed into the same parts (analysis, commentary
                calls, final)
    volatile.py the system and message text blocks dropped before rendering (Claude Code's
                billing header: cache.volatile_prompt_patterns), and their count

A protocol front-end (openai/, anthropic/, responses/) turns its own messages into template dicts
(role, content, tool_calls, tool_call_id, reasoning_content) and its tools into OpenAI-style
function dicts, and calls these; it reads every answer through answer.py and only translates the
parts into its own wire events.
It may import: pipeline and below (shared), the engine's structured grammars; no protocol package.
"""
