"""The model's math: the Engram spec, head sharding, the n-gram hashes (batch
and incremental), the tokenizer map and the FP8 format.  Pure functions of
their inputs; nothing here touches the host or the store.

May import: ``errors``, ``units``, ``bindings``.  Never torch at module level
(``fp8`` imports it inside the functions that make tensors).
"""
