"""A serving stream for EngramRuntime tests, and its reference.

``replica_plan`` makes one DP replica's steps: requests with image spans,
a prefill chunk each, then decode steps of 1-3 tokens, some with
speculative (uncommitted) tokens, one request preempted and resumed in
another slot by ``restore``, packed in random request orders.  Every rank
of a replica builds the same plan from the same seed.

``reference_rows`` is the route the runtime must agree with, bit for bit:
each token's whole sequence (what came before it in its request, then
itself) hashed with ``ngram_hashes`` (a DEAD token cuts the sequence: the
ids after it hash as a new sequence, the DEAD one as all-pad n-grams),
plus the layer's head offsets, looked up in one TP-1 table of the whole
layer.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from numa_engram.model.hashing import ngram_hashes


@dataclass
class Step:
    ids: list = field(default_factory=list)        # tokenizer ids, packed
    slots: list = field(default_factory=list)
    positions: list = field(default_factory=list)
    commit: list = field(default_factory=list)
    contexts: list = field(default_factory=list)   # each token's sequence up to itself
    releases: list = field(default_factory=list)   # slots released before the step
    restores: list = field(default_factory=list)   # (slot, position, prefix ids) before it

    def commit_array(self):
        return np.array(self.commit, dtype=bool)


def replica_plan(seed: int, steps: int, vocab: int, image_id: int, max_slots: int = 6,
                 n_requests: int = 4) -> list:
    """``steps`` steps of one replica (some may be empty: an idle replica)."""
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(n_requests):
        seq = [int(x) for x in rng.integers(0, vocab, int(rng.integers(6, 16)))]
        if rng.random() < 0.6:  # an image span
            a = int(rng.integers(1, len(seq) - 1))
            seq[a:a + int(rng.integers(1, 3))] = [image_id] * 2
            seq = seq[:16]
        requests.append({"seq": seq, "done": 0, "slot": None,
                         "preempt": bool(rng.random() < 0.5)})
    free = list(rng.permutation(max_slots))
    plan = []
    for step_no in range(steps):
        step = Step()
        pieces = []
        for req in requests:
            if req["done"] == len(req["seq"]):
                if req["slot"] is not None:
                    step.releases.append(req["slot"])
                    free.append(req["slot"])
                    req["slot"] = None
                continue
            if req["slot"] is None:
                if not free or step_no == 0 and rng.random() < 0.3:
                    continue
                req["slot"] = int(free.pop(0))
            elif req["preempt"] and req["done"] > 3:  # resumed in another slot
                req["preempt"] = False
                step.releases.append(req["slot"])
                if free:
                    old, req["slot"] = req["slot"], int(free.pop(0))
                    free.append(old)
                window = int(rng.integers(3, req["done"] + 1))
                step.restores.append((req["slot"], req["done"],
                                      req["seq"][req["done"] - window:req["done"]]))
            if rng.random() < 0.25:
                continue  # sits this step out
            a = req["done"]
            b = min(len(req["seq"]), a + (int(rng.integers(3, 8)) if a == 0 else
                                          int(rng.integers(1, 3))))
            spec_ids = [int(x) for x in rng.integers(0, vocab, int(rng.integers(0, 3)))]
            hypothetical = req["seq"][:b] + spec_ids
            tokens = [(req["slot"], p, req["seq"][p], True, hypothetical[:p + 1])
                      for p in range(a, b)]
            tokens += [(req["slot"], b + k, t, False, hypothetical[:b + k + 1])
                       for k, t in enumerate(spec_ids)]
            req["done"] = b
            pieces.append(tokens)
        # a random request order, each request's tokens in order
        order = rng.permutation(sum(len(p) for p in pieces))
        owner = [i for i, p in enumerate(pieces) for _ in p]
        cursor = [0] * len(pieces)
        for j in order:
            i = owner[j]
            slot, pos, tok, commit, context = pieces[i][cursor[i]]
            cursor[i] += 1
            step.ids.append(tok)
            step.slots.append(slot)
            step.positions.append(pos)
            step.commit.append(commit)
            step.contexts.append(context)
        plan.append(step)
    return plan


def v41_hashes(spec, compressed, layer):
    """Bucket ids ``[len, n_hash_cols]`` of one sequence (DEAD = -1), one
    token at a time: its n-grams from the ids before it back to the last
    DEAD or the start (the library's sequence_hashes does it by segments)."""
    out = np.empty((len(compressed), spec.n_hash_cols), dtype=np.int64)
    n1 = spec.max_ngram_size - 1
    for p, tok in enumerate(compressed):
        if tok < 0:
            window = [spec.pad_id]
        else:
            back = p
            while back > 0 and p - back < n1 and compressed[back - 1] >= 0:
                back -= 1
            window = compressed[back:p + 1]
        out[p] = ngram_hashes(spec, np.array(window), layer)[-1]
    return out


def reference_rows(model, tables, step, layer):
    """BF16 ``[T, n_hash_cols, head_dim]``: each token's row from its whole sequence."""
    spec = model.spec
    dead = set(model.dead_ids)
    ids = np.empty((len(step.ids), spec.n_hash_cols), dtype=np.int64)
    for t, context in enumerate(step.contexts):
        compressed = [-1 if tok in dead else int(model.token_map[tok]) for tok in context]
        ids[t] = v41_hashes(spec, compressed, layer)[-1]
    rows = ids + spec.head_offsets(layer)
    return tables[layer].lookup(rows, id_format="global")


def sp_window(full, tp, rank):
    """What a sequence-parallel rank keeps: its ceil(T/tp) tokens, zeros past T."""
    t = full.shape[0]
    width = -(-t // tp)
    out = torch.zeros((width, *full.shape[1:]), dtype=full.dtype)
    first = rank * width
    real = max(0, min(width, t - first))
    out[:real] = full[first:first + real]
    return out


def same_bits(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
