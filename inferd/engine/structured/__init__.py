"""Grammar-constrained decoding (llguidance), shared by both sides of the seam.

    grammar.py  grammar text from JSON schemas, regexes, choices, Lark; the compiler and the
                per-choice constraint (the API compiles, a bad grammar is the client's 400)
    masks.py    a step's token masks, filled on a worker thread while the model runs
    repeats.py  the stop on a repeated tool call (a span between two tags seen before)
    budget.py   a thinking budget: the reasoning's closing marker forced once N tokens are spent

No torch: part of the engine's face.
"""
