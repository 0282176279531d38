"""Checkpoint reading: one safetensors core (the files, the index and
headers read once, regular files only, each file unchanged before and after
a load), thin per-family readers (Engram, PLE), the file mappings the
mapped tier reads, and the synthetic checkpoint writers.

May import ``store``, ``host``, ``model`` and ``bindings``; torch only inside
the synthetic writers' functions (importing this folder does not import it).
"""
