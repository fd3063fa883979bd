"""The engine: requests in, tokens out, on its own thread. Its face is what the API may import:

    async_engine.py  `AsyncEngine`: submit, abort, pause, outputs, the published snapshot (no torch)
    protocol.py      the seam's types: EngineRequest, EngineOutput, StepOutputs, EngineLimits,
                     EngineSnapshot and its parts, EngineCore (what AsyncEngine drives)
    structured/      grammars (the API compiles them; the engine fills their masks)

Behind it, in the order one step runs them:

    llm_engine.py  `LLMEngine`: add_request, step, abort; the one writer of requests' lives
    builder.py     model, KV cache, runner and CUDA graphs, built once;  config.py: EngineConfig
    sched/         the scheduler: classes, deadlines, fair share, shedding (ids and counts only)
    kv/            the block manager, its pool and prefix cache (block ids only, no tensors)
    worker/        the step as tensors: the runner, its executor, the KV cache, CUDA graphs
    output/        detokenize, stops, the blocklist and segments: one EngineOutput per choice
    health.py      failed steps in a row, out-of-memory events

Imports point down that list (pyproject.toml's contracts): nothing here imports the API, and
sched/ and kv/ never see a tensor.
"""
