"""The one generation path every protocol front-end shares (generate.py):

    authorize (gateway) -> choose the model (routing) -> prompts (the front-end's Shape)
    -> prepare: every limit once (the model's door) -> charge the tenant (gateway)
    -> admit and submit (the door) -> gather or stream (streaming) -> the record (telemetry)

A front-end gives it two things per request:
    an `Ask` (admission/ask.py): model, n, stream, priority, user, max_tokens, logprobs,
        sampling, timeouts, segment, resumable, and a grammar builder: no wire format in it;
    a `Shape` (shape.py): the prompts' token ids for the chosen model's tokenizer, the prompt as
        text for the logs, a whole reply's JSON body, a stream's head, per-output render and tail
        (and, for a background response, where its events go while the request is answered).
Everything else (403/404/400/429/503 in the order the stages meet them, the tenant's charge
and refund, fallbacks, cascades, the ladder, resumable streams, slow clients, the request's
log line) it does the same way for every protocol.
"""
