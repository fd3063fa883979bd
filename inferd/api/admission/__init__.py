"""The admission stage: a model's door.

    ask.py     what a front-end asks (`Ask`) and what the checks make of it (`Prepared`)
    door.py    `FrontDoor`: prepare (every limit, once: 400s) and admit (queues, then submit)
    queues.py  each class's bounded waiting queue and Retry-After (pure: the clock is injected)

Owns each revision's queues and prefill-rate window (event loop only); its counts belong to
the model's slot. Imports the shared api modules, the engine's face and the settings only.
"""
