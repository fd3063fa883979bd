"""The streaming stage: the answer on its way out.

    generation.py    one HTTP request's engine requests, admitted to their end: gathered, or
                     streamed, and aborted however the handler is left
    sse.py           server-sent events by hand, and the batching of engine outputs
    backpressure.py  a client that does not read is paused, then cut
    resume.py        the event log a task produces into: resumable streams and /v1/streams/<id>,
                     and the Responses API's background responses

Owns the open streams and the resumable ones (event loop only). Imports admission (the door a
generation is admitted through), the gateway (its ticket, the caller), the shared api modules
and the engine's face.
"""
