"""The one generation path every protocol front-end shares (generate.py), and its prompt-only
sibling for embeddings, rerank and score (pooling.py):

    authorize (gateway) -> choose the model (routing) -> prompts, grammar and thinking budget
    (the front-end's Shape.prepare) -> prepare: every limit once (the model's door) -> charge the
    tenant (gateway) -> admit and submit (the door) -> gather or stream (streaming) -> the record

A front-end gives it two things per request:
    an `Ask` (admission/ask.py): model, n, stream, priority, user, max_tokens, logprobs,
        sampling, timeouts, segment, resumable, the session it names (sessions.py reads the
        x-session-id header and the body's key) and the volatile blocks its prompt lost
        (conversation/volatile.py): plain data, no wire format in it;
    a `Shape` (shape.py): for the chosen model's tokenizer, in one call, the prompts' token ids,
        the grammar and the thinking budget (a `Shaped`, which goes into the Ask); then the
        prompt as text for the logs, a whole reply's JSON body, a stream's head, per-output
        render and tail (and, for a background response, where its events go while the request
        is answered). Its answers are read by the one decoder (conversation/answer.py).
Everything else (403/404/400/429/503 in the order the stages meet them, the tenant's charge
and refund, fallbacks, cascades, the ladder, resumable streams, slow clients, the request's
log line) it does the same way for every protocol.
"""
