"""Data: dataset files -> documents -> tokens -> packed blocks -> the batches of each step.

`render` turns chess games into text; `prepare` tokenises and packs a dataset once, cached
on disk under a key of everything that determines it; `blocks` reads the prepared blocks at
training time and decides which blocks every rank sees at every step (a pure function of the
step); `document_masking` keeps packed documents from attending to each other.
"""
