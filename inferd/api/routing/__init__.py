"""The routing stage: which model answers a request, and the life of the models.

    registry.py     `ModelRegistry`: every served name's slot, aliases, routes; `pick`
    slot.py         `ModelSlot`: one name's revisions, life, degradation and counts
    served.py       one loaded revision: its engine, its door, its probe
    life.py         a slot's state (serving, loading, asleep, ...) and lifecycle counts
    lifecycle.py    models on demand: loads, unloads (idle, models_max), sleep and wake
    holds.py        every use of a model's engine holds it: `acquire` (pick, wait, hold)
    routes.py       split and cascade routes, sticky per user (pure)
    degradation.py  fallback on unhealthy or overloaded models, and the functional ladder (pure)
    reload.py       a new revision loaded beside the old one, proved, swapped in
    probe.py        the inference probe: a fixed greedy prompt at start-up and while idle

Owns the slots, their revisions and their counters (event loop only). Imports the admission
stage (each revision has a door), the shared api modules, the engine's face, the settings.
"""
