"""The telemetry stage: finalize and measure.

    access_log.py    one log line per API request when it ends; the JSON log format
    request_file.py  the request file (JSON lines, redacted, on a writer thread) and drift's feed
    drift.py         prompts and answers now against a baseline (pure)
    metrics.py       GET /metrics: every stage's state, read at each scrape
    status.py        GET /v1/status, and the tenants' rows of /admin/tenants
    status_wire.py   the status page's models

Writes nothing any other stage reads: it reads them all (the registry, the gateway, the
streams), and the request's record (api/record.py) the stages fill in.
"""
