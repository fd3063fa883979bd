"""The routing stage: which model answers a request, and the life of the models.

    registry.py     `ModelRegistry`: every served name's slot, aliases, routes; `choose`
    served.py       one loaded revision: its engine, its door, its probe
    routes.py       split and cascade routes, sticky per user (pure)
    degradation.py  fallback on unhealthy or overloaded models, and the functional ladder (pure)
    reload.py       a new revision loaded beside the old one, proved, swapped in
    probe.py        the inference probe: a fixed greedy prompt at start-up and while idle

Owns the slots, their revisions and their counters (event loop only). Imports the admission
stage (each revision has a door), the shared api modules, the engine's face, the settings.
"""
