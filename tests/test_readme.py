"""README.md's Python blocks, run as written, so the README cannot drift
from the code.  The blocks form one program (the serving section goes on
with the table of the API section); it needs a sharing group, so it runs in
4 real processes (TP 2 x DP 2) launched as torchrun launches a job (env://
on 127.0.0.1), in a directory holding the checkpoint the README names.
The inputs the README leaves to the reader (a tokenizer's ids and token
map, a scheduler's batch) get small stand-ins, defined before the blocks."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from numa_engram import EngramSpec
from numa_engram.checkpoints.synthetic import write_synthetic_checkpoint

from .support.dist_harness import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
# after a program's last line: the ranks leave together (gloo aborts a
# process that exits while a peer still talks to it: "terminate called
# without an active exception")
LEAVE = ("\nimport torch.distributed as _dist\n_dist.barrier()\n"
         "_dist.destroy_process_group()\n")
WORLD = 4

# what the README's reader brings: a tokenizer's ids and compressed map, an
# image token, and a scheduler's packed batches (request A in slot 0, B in 1)
STAND_INS = '''
import numpy as np
compression_table = np.arange(129_280) % 99_092
IMAGE_TOKEN_ID = 128_000
token_ids = np.array([5, 17, 128_000, 128_000, 42, 7, 9, 11, 3, 3, 8, 1000])
slots = [0] * 7 + [1] * 5
positions = list(range(7)) + list(range(5))
is_image_token = token_ids == IMAGE_TOKEN_ID
len_a, len_b = 7, 5
next_ids = [77, 78]
draft_ids = token_ids[::-1].copy()
is_verified = np.arange(len(draft_ids)) < 6
position, prefix_ids = 3, token_ids[7:10]
'''


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def _spec_of(program: str) -> EngramSpec:
    """The spec the README builds (its checkpoint must carry the same)."""
    start = program.index("EngramSpec(")
    depth = 0
    for end in range(start, len(program)):
        depth += {"(": 1, ")": -1}.get(program[end], 0)
        if program[end] == ")" and depth == 0:
            break
    expression = re.sub(r"#[^\n]*", "", program[start:end + 1])
    return eval(expression, {"EngramSpec": EngramSpec})  # the README's own expression


def test_the_readme_has_the_python_blocks_this_test_runs():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 3, "README.md lost its Python examples"
    assert "EngramRuntime.from_pretrained" in blocks[0]  # serving with the runtime comes first
    assert "SharedEngramTable.create" in blocks[1] and "HashState" in blocks[2]


def _run_world(tmp_path, program: str, world: int = WORLD) -> list[tuple[int, str]]:
    """``program`` in ``world`` processes launched as torchrun would (env://)."""
    script = tmp_path / "readme_program.py"
    script.write_text(program)
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:  # only the processes this test started
                q.kill()
            raise
        outputs.append((p.returncode, out))
    return outputs


@pytest.mark.multiproc
def test_the_readmes_runtime_example_runs_as_written(tmp_path):
    """The serving loop, with nothing added but a line that prints its rows."""
    program = python_blocks(README.read_text())[0]
    outputs = _run_world(tmp_path, program + "\nprint('README-RUNTIME-DONE', "
                         "{k: list(v.shape) for k, v in engram_rows.items()})\n" + LEAVE)
    for rank, (code, out) in enumerate(outputs):
        assert code == 0, f"rank {rank} failed:\n{out[-3000:]}"
        assert "README-RUNTIME-DONE {1: [2, 12, 64], 14: [2, 12, 64]}" in out, out[-2000:]
        assert "'mode': 'dp_shared'" in out and "'tp_size': 2" in out, out[-2000:]


@pytest.mark.multiproc
def test_the_readmes_python_runs_as_written(tmp_path):
    program = "\n".join(python_blocks(README.read_text())[1:])
    checkpoint = re.search(r'checkpoint=\["([^"]+)"\]', program).group(1)
    write_synthetic_checkpoint(tmp_path / checkpoint, _spec_of(program))
    outputs = _run_world(tmp_path, STAND_INS + program
                         + "\nprint('README-PROGRAM-DONE', rows.shape)\n" + LEAVE)
    for rank, (code, out) in enumerate(outputs):
        assert code == 0, f"rank {rank} failed:\n{out[-3000:]}"
        assert "README-PROGRAM-DONE torch.Size([12, 12, 256])" in out, out[-2000:]
        assert "'mode': 'dp_shared'" in out, out[-2000:]


def test_the_with_vllm_section_runs_as_far_as_it_can_without_vllm():
    """README's "With vLLM": its --additional-config is accepted by the
    plugin's settings, every key its table names is one the plugin takes,
    the plugin it names is the package's entry point, and the command is
    the documented one."""
    import json

    from numa_engram.integrations.vllm.settings import KEYS, PluginSettings

    text = README.read_text()
    section = text[text.index("## With vLLM"):text.index("## Serving with EngramRuntime")]
    assert "VLLM_PLUGINS=numa_engram vllm serve" in section
    config = json.loads(re.search(r"--additional-config '(\{.*?\})'", section).group(1))
    settings = PluginSettings.of(config)
    assert settings.page_size == "2M" and settings.placement == "gpu-local"
    table = section[section.index("The keys of"):]
    named = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)? \|", table, flags=re.M))
    assert {k for pair in named for k in pair if k} == set(KEYS)


SOCKET_STAND_INS = '''
import os, sys
from numa_engram import EngramSpec, SharedEngramTable, shard_heads
spec = EngramSpec.small(rows_per_head=500, n_head_per_ngram=2, head_dim=64)
layer, tp_rank, dp = spec.layer_ids[0], 0, 2
shard = shard_heads(spec.bucket_sizes(layer), 1, 0)
dp_rank, run_dir, ckpt = int(os.environ["RANK"]), os.getcwd(), "engram.safetensors"
'''


@pytest.mark.multiproc
def test_the_readmes_socketgroup_example_runs_as_written(tmp_path):
    """Two replicas (no torch.distributed) share one copy through the
    README's SocketGroup lines, and the socket is gone afterwards."""
    from numa_engram.checkpoints.synthetic import write_raw_checkpoint

    (program,) = re.findall(r"^```python socketgroup\n(.*?)^```", README.read_text(),
                            flags=re.M | re.S)
    spec = EngramSpec.small(rows_per_head=500, n_head_per_ngram=2, head_dim=64)
    write_raw_checkpoint(tmp_path / "engram.safetensors", spec)
    outputs = _run_world(tmp_path, SOCKET_STAND_INS + program + "\nprint('README-SOCKET', "
                         "table.mode_report()['mode'], table.mode_report()['sharing_group'], "
                         "'torch' in sys.modules)\ntable.close()\n", world=2)
    for code, out in outputs:
        assert code == 0 and "README-SOCKET dp_shared [0, 1] False" in out, out[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["engram.safetensors", "readme_program.py"]


PLE_STAND_INS = '''
import numpy as np
import torch.distributed as dist
from numa_engram.groups.group import sharing_groups
dist.init_process_group("gloo")
rank = dist.get_rank()
tp_rank = rank % 2  # TP 2 x DP 2, TP-minor as vLLM numbers ranks
tp_group = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
sharing_group = sharing_groups(tp_rank=tp_rank)  # the DP replicas of this TP rank
token_ids = np.array([5, 17, 7, 42, 7, 9, 11, 3, 3, 8, 1000, 2])
'''


@pytest.mark.multiproc
def test_the_readmes_qwen4_exp_example_runs_as_written(tmp_path):
    """The PLE example in 4 processes (TP 2 x DP 2) over a Qwen4-Exp
    directory of the name it uses: the DP replicas of a TP rank share its
    table, every TP rank ends with the whole table's rows."""
    from numa_engram.model.ple import PLESpec

    from .support.ple_scenarios import write_ple_model

    (program,) = re.findall(r"^```python ple\n(.*?)^```", README.read_text(), flags=re.M | re.S)
    spec = PLESpec(layer_ids=[2, 5], ple_embed_dim=160, vocab_size=5000, eos_token_id=7,
                   ngram_vocab_size_base=3000, split_ngram_parts=7)
    write_ple_model(tmp_path / "Qwen3.8-Flash-Next", spec)
    outputs = _run_world(tmp_path, PLE_STAND_INS + program + "\nprint('README-PLE-DONE', "
                         "list(rows.shape), table.mode)\ntable.close()\n" + LEAVE)
    for rank, (code, out) in enumerate(outputs):
        assert code == 0, f"rank {rank} failed:\n{out[-3000:]}"
        assert "README-PLE-DONE [12, 16, 10] dp_shared" in out, out[-2000:]
