"""The Engram layer a server drops in: a model directory read as DeepSeek
ships one (``modeldir``), the TP head gather and the sequence-parallel
window (``tpgather``), and ``EngramRuntime`` (``engine``), which wires the
token map, the spec, the sharing groups, one table per layer, the hashing
and the prefetch into one call per step."""
