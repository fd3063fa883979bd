"""The gateway stage: who calls and what they may use.

    keys.py       API keys as SHA-256 digests, the auth middleware, the caller's principal
    tenants.py    tenants and the keyring (key digest -> principal)
    ratelimit.py  each tenant's request and token buckets (pure: the clock is injected)
    gate.py       `Gateway`: authorize (model, class), charge (the buckets), the tenant accounts

Owns the keyring, the buckets and the accounts (event loop only). Imports the shared api
modules (errors, record), the engine's face for its types, and the settings; no other stage.
"""
