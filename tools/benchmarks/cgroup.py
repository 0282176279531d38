"""A mapped table served under a memory cgroup of its own limited to 25% of
the table (issue 52): decode steps whose ids are a real text's, hashed
through a byte-level BPE tokenizer trained on that text (the V4.1 token
map built from it), keep being served with no OOM kill; the pages' hit
rate (read-ahead by hash id counts them) and the step time, beside the same
stream with no limit.

The table is V4.1-shaped (256-byte FP8 rows and their scales, 24 hash
heads, 4-grams) and raw random bytes (no torch); the corpus defaults to
this repository's own prose (README, docs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .mapped import HEAD_DIM, HEADS, drop_file_pages

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = [REPO / "README.md", REPO / "CONTRIBUTING.md",
                  *sorted((REPO / "docs").glob("*.md"))]
REQUESTS = 8        # sequences decoding together: a step is one token of each
VOCAB = 8192


def _tokenizer(texts: list[str]):
    """A byte-level BPE tokenizer trained on ``texts`` (as DeepSeek's is
    byte-level BPE), its decoder set so the V4.1 token map can be built."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def _model(d: Path, texts: list[str], gib: float, layers: int) -> Path:
    """A model directory: config.json, the trained tokenizer.json and a raw
    V4.1-shaped checkpoint of ``gib`` GiB over ``layers`` layers."""
    from numa_engram import EngramSpec
    from numa_engram.checkpoints.synthetic import write_raw_checkpoint
    from numa_engram.model.tokenmap import build_token_map
    from numa_engram.runtime.modeldir import model_config

    tok = _tokenizer(texts)
    _, compressed = build_token_map(tok)
    per_head = int(gib * 2**30) // (HEAD_DIM + HEAD_DIM // 32) // HEADS // layers
    spec = EngramSpec(layer_ids=list(range(1, layers + 1)), engram_vocab_sizes=[per_head] * 3,
                      max_ngram_size=4, n_head_per_ngram=8, head_dim=HEAD_DIM,
                      compressed_vocab_size=compressed, pad_id=2)
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps(model_config(spec, None, tok.get_vocab_size())))
    path = d / "model.safetensors"
    write_raw_checkpoint(path, spec)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # written back: a dirty page cannot be dropped (nor charged to the child)
    os.close(fd)
    return d


class Cgroup:
    """A child memory cgroup of this process's own (v2 with the memory
    controller, else v1) with a limit, or None where none can be made."""

    NAMES = {"v2": ("memory.max", "memory.events", "memory.peak"),
             "v1": ("memory.limit_in_bytes", "memory.oom_control", "memory.max_usage_in_bytes")}

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = path, kind

    @classmethod
    def make(cls, limit: int) -> Cgroup | None:
        from numa_engram.host.accounting import _cgroup_dirs

        for cgroup, _mount, kind in _cgroup_dirs():
            if kind == "v2" and "memory" not in (cgroup / "cgroup.controllers").read_text():
                continue
            path = cgroup / f"numa-engram-bench-{os.getpid()}"
            try:
                path.mkdir()
                (path / cls.NAMES[kind][0]).write_text(str(limit))
            except OSError:
                continue
            return cls(path, kind)
        return None

    def oom_kills(self) -> int:
        """The cgroup's OOM kills (v1 oom_control's oom_kill, v2 memory.events')."""
        for line in (self.path / self.NAMES[self.kind][1]).read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def peak(self) -> int | None:
        try:
            return int((self.path / self.NAMES[self.kind][2]).read_text())
        except OSError:
            return None

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # the child still exiting
                time.sleep(0.1)


def serve(model_dir: str, profile: str, steps: int, procs: str) -> None:
    """The child: into the cgroup (``procs``: its cgroup.procs, or ''), the
    model's mapped tables, then ``steps`` decode steps of REQUESTS tokens,
    each layer's rows read ahead by hash id (counting the pages already in
    memory) and looked up; one JSON line of what it measured."""
    if procs:
        Path(procs).write_text(str(os.getpid()))
    from numa_engram import SharedEngramTable, shard_heads
    from numa_engram.model.hashstate import HashState
    from numa_engram.runtime.modeldir import ModelDirectory, read_tokenizer

    model = ModelDirectory.open(model_dir)
    spec = model.spec
    tok = read_tokenizer(os.path.join(model_dir, "tokenizer.json"))
    corpus = json.loads(Path(profile).read_text())["corpus"]
    text = "\n".join(Path(p).read_text() for p in corpus)
    ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    tables = [SharedEngramTable.create(spec, layer, shard_heads(spec.bucket_sizes(layer), 1, 0),
                                       checkpoint=model_dir, tier="mapped")
              for layer in spec.layer_ids]
    state = HashState(spec, REQUESTS, model.token_map, model.dead_ids)
    # each request decodes the corpus from its own starting point, round and round
    starts = np.arange(REQUESTS) * (len(ids) // REQUESTS)
    slots = np.arange(REQUESTS, dtype=np.int64)
    times, hits, pages = [], [], []
    for step in range(steps):
        position = np.full(REQUESTS, step, dtype=np.int64)
        hashes = state.hash(ids[(starts + step) % len(ids)], slots, position)
        t0 = time.perf_counter()
        counted = [table.readahead(hashes[:, i]) for i, table in enumerate(tables)]
        for i, table in enumerate(tables):
            table.lookup(hashes[:, i])
        times.append(time.perf_counter() - t0)
        hits.append(sum(c[0] for c in counted))
        pages.append(sum(c[1] for c in counted))
    for table in tables:
        table.close()
    half = len(times) // 2  # the second half: past the cold start
    status = Path("/proc/self/status").read_text().splitlines()
    anon = next(int(line.split()[1]) << 10 for line in status if line.startswith("RssAnon:"))
    print(json.dumps({"steps": steps, "anon_bytes": anon, "hit_rate": sum(hits) / sum(pages),
                      "late_hit_rate": sum(hits[half:]) / sum(pages[half:]),
                      "step_ms": 1e3 * np.median(times),
                      "late_step_ms": 1e3 * np.median(times[half:]),
                      "p99_ms": 1e3 * float(np.percentile(times, 99))}))


def _run_child(model_dir: Path, profile: Path, steps: int, cgroup: Cgroup | None) -> dict:
    drop_file_pages(str(model_dir / "model.safetensors"))  # cold, and charged to the child
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'tools')!r}); "
            "from benchmarks.cgroup import serve; serve(*sys.argv[1:3], int(sys.argv[3]), "
            "sys.argv[4])")
    procs = str(cgroup.path / "cgroup.procs") if cgroup else ""
    out = subprocess.run([sys.executable, "-c", code, str(model_dir), str(profile), str(steps),
                          procs], capture_output=True, text=True, timeout=3600)
    if out.returncode:
        return {"returncode": out.returncode, "stderr": out.stderr[-2000:]}
    return {"returncode": 0, **json.loads(out.stdout.splitlines()[-1])}


def bench_cgroup(gib: float = 2.0, layers: int = 2, steps: int = 4000,
                 corpus: list[str] | None = None) -> None:
    from numa_engram.cli.app import main
    from numa_engram.store.accessprofile import curve_fraction

    files = [Path(p) for p in corpus] if corpus else DEFAULT_CORPUS
    limit = int(gib * 2**30) // 4
    print(f"== mapped table under a memory cgroup of 25% of it: {gib:g} GiB over {layers} "
          f"layers, limit {limit / 2**20:.0f} MiB; {steps} decode steps of {REQUESTS} tokens "
          f"from {len(files)} corpus file(s) through a trained byte-level BPE tokenizer")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR", "/tmp")) as d:
        texts = [f.read_text() for f in files]
        model_dir = _model(Path(d) / "model", texts, gib, layers)
        profile = Path(d) / "profile.json"
        budget = f"{limit // 2**20}M,{2 * limit // 2**20}M,{int(gib * 1024)}M"
        main(["profile", str(model_dir), *map(str, files), "--budget", budget,
              "--out", str(profile)])
        doc = json.loads(profile.read_text())
        free = _run_child(model_dir, profile, steps, None)
        cgroup = Cgroup.make(limit)
        if cgroup is None:
            print("  skipped: no writable memory cgroup here (v2 with the memory controller, "
                  "or v1)")
            return
        try:
            limited = _run_child(model_dir, profile, steps, cgroup)
            kills, peak = cgroup.oom_kills(), cgroup.peak()
        finally:
            cgroup.remove()
    print(f"  cgroup {cgroup.kind} {cgroup.path.name}: OOM kills {kills}, peak "
          f"{(peak or 0) / 2**20:.0f} MiB of the {limit / 2**20:.0f} MiB limit; the child "
          f"exited {limited['returncode']}")
    if limited["returncode"] or free["returncode"]:
        print(f"  FAILED: limited {limited}, no limit {free}")
        return
    # the page cache gets what the engine's own memory (torch, numpy) leaves
    room = limit - limited["anon_bytes"]
    print(f"  the profile (hottest pages kept): {doc['budgets'][0]['fraction']:.1%} of page reads "
          f"at the limit, {curve_fraction(doc['curve'], room):.1%} at the "
          f"{room / 2**20:.0f} MiB the process's {limited['anon_bytes'] / 2**20:.0f} MiB of "
          "anonymous memory leaves the page cache")
    for name, r in (("limited", limited), ("no limit", free)):
        print(f"  {name:9s}: page hit rate {r['hit_rate']:6.1%}, {r['late_hit_rate']:6.1%} in "
              f"the second half | step {r['step_ms']:6.3f} ms median, "
              f"{r['late_step_ms']:6.3f} ms in the second half "
              f"({r['late_step_ms'] / free['late_step_ms']:.2f}x no limit's), "
              f"p99 {r['p99_ms']:6.3f} ms")
