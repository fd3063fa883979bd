"""The HTTP server: no torch, not even indirectly. A request goes through the stages in order,
each a package that owns its state:

    gateway/    who calls and what they may use: keys, tenants, rate limits, the charge
    routing/    which model answers: the models (registry), routes, degradation, reload, probe
    admission/  the model's door: every limit checked once (prepare), then bounded queues (admit)
    streaming/  the answer on its way out: the engine requests' life, SSE, backpressure, resume
    telemetry/  finalize and measure: the access log, the request file, drift, metrics, status
    pipeline/   the one generation path that runs those stages in order, for every protocol
    openai/     the OpenAI protocol: wire models, chat, completions, tokenize, logprobs, tools
    anthropic/  Anthropic's Messages protocol
    responses/  OpenAI's Responses protocol, and its store of responses (per tenant, bounded)

Around them: app.py (the application and its lifecycle), server.py (`inferd serve`),
endpoints.py (the endpoint table), openapi.py, admin.py, and what every stage shares: state.py,
errors.py, body.py, wire.py, record.py, systemd.py, startup.py (the start-up line, written and read).

Imports point down this list, read bottom-up: a protocol package imports the pipeline, the
pipeline imports the stages, a stage imports the stages below it and the shared modules, and
none imports up (pyproject.toml's import-linter contracts hold it). The engine is reached only
through its face (inferd.engine.async_engine, .protocol, .structured).
"""
