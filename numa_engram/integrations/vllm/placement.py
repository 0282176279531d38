"""Where an engine's tables come from, decided once per engine for both
families: attached from a table service, one copy shared by the DP peers
(``dp_shared``), or a private table per rank.

The state is the engine's (its ``vllm_config``), never the process's: a
second engine built in the same process (RL and rollout loops do this)
decides again, and the weights mapper drops the checkpoint tensors of the
layers this engine attached, no others.  The DP peers decide together:
they gather their settings, whether the service answers them and whether
their table directory has room (one bounded collective), so every member
takes the same branch or every member fails with the same PluginError.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ...literals import DEFAULT_DIRECTORY
from .settings import PluginError, PluginSettings

log = logging.getLogger("vllm." + __name__)

Source = Literal["service", "dp_shared", "independent"]
DEFAULT_SOCKET = "/run/numa-engram/engram.sock"
# how long the DP peers wait for each other's settings (a peer that never
# constructs the model: its startup failed)
AGREE_TIMEOUT_S = 120.0
FALL_BACK = "numa_engram: the DP peers cannot share one copy (%s); one table per rank"


@dataclass(frozen=True)
class Decision:
    """Where this rank's tables come from (``service``: the socket)."""

    source: Source
    service: str | None = None


@dataclass
class Engine:
    """One engine's plugin state: its decision per DP group, its sharing
    groups, and the Engram layers it attached (the mapper drops exactly
    their tensors)."""

    decisions: dict[tuple, Decision] = field(default_factory=dict)
    groups: dict[tuple, Any] = field(default_factory=dict)
    attached: set[int] = field(default_factory=set)
    specs: dict[str, Any] = field(default_factory=dict)  # by family, from its hf_config
    statuses: dict[str, dict] = field(default_factory=dict)  # by service socket, for reports
    said: set[str] = field(default_factory=set)  # the lines logged once per engine


_ENGINES: list[tuple[Any, Engine]] = []  # (a reference to the engine's config, its state)


def engine(config: Any) -> Engine:
    """The state of the engine whose config is ``config`` (made on first use)."""
    for ref, state in _ENGINES:
        if _deref(ref) is config:
            return state
    _ENGINES[:] = [(ref, state) for ref, state in _ENGINES if _deref(ref) is not None]
    state = Engine()
    try:
        held: Any = weakref.ref(config)
    except TypeError:  # (a config without weak references: kept alive)
        held = config
    _ENGINES.append((held, state))
    return state


def _deref(ref: Any) -> Any:
    return ref() if isinstance(ref, weakref.ref) else ref


def current_attached() -> set[int]:
    """The Engram layers the engine now being constructed attached (vLLM's
    current config), empty outside one."""
    import importlib

    config = importlib.import_module("vllm.config").get_current_vllm_config()
    for ref, state in _ENGINES:
        if _deref(ref) is config:
            return set(state.attached)
    return set()


def service_path(settings: PluginSettings) -> str | None:
    """The table service's socket the settings name, or None.  ``"auto"``:
    the default socket where a service listens at it; a socket file nobody
    listens at (a dead service's) is logged and the tables are built."""
    if settings.service != "auto":
        return settings.service
    path = os.environ.get("NUMA_ENGRAM_SOCKET", DEFAULT_SOCKET)
    if not os.path.exists(path):
        return None
    if not listening(path):
        log.warning("numa_engram: service \"auto\": nobody listens at %s (a stopped table "
                    "service's socket); the tables are built here", path)
        return None
    return path


def listening(path: str) -> bool:
    """Whether a process listens at the Unix socket ``path`` (a full
    queue counts; a socket this user may not connect to counts too: the
    attach then names it)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except (BlockingIOError, PermissionError):
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return True


def decide(config: Any, settings: PluginSettings, dp: Any, *, shared_asked: bool,
           one_place: bool = True) -> Decision:
    """This engine's decision for the DP group ``dp`` (vLLM's coordinator,
    None: no peers), once per engine and group; a collective over ``dp``.
    ``shared_asked``: vLLM asks its DP replicas to share the tables;
    ``one_place``: sharing needs every peer on one host (Engram: vLLM's
    forward then skips its DP exchange), else the sharing groups say."""
    state = engine(config)
    key = tuple(dp.ranks) if dp is not None and hasattr(dp, "ranks") else (id(dp),)
    if key not in state.decisions:
        state.decisions[key] = _decide(settings, dp, shared_asked, one_place)
    return state.decisions[key]


def _decide(settings: PluginSettings, dp: Any, shared_asked: bool,
            one_place: bool) -> Decision:
    service = service_path(settings)
    here = share_here(settings) if shared_asked else (True, (), "")
    answers = agree(dp, {"settings": asdict(settings), "service": service, "here": here})
    if all(a["service"] is not None for a in answers):
        return Decision("service", service)
    if any(a["service"] is not None for a in answers):
        log.warning("numa_engram: service \"auto\": the table service answers only some DP "
                    "replicas; the tables are built here")
    peers = dp is not None and dp.world_size > 1
    if not (shared_asked and peers):
        return Decision("independent")
    problems = sorted({a["here"][2] for a in answers if a["here"][2]})
    if problems or (one_place and len({tuple(a["here"][1]) for a in answers}) > 1):
        log.warning(FALL_BACK, "; ".join(problems) or "they are not on one host with one "
                    "table directory")
        return Decision("independent")
    return Decision("dp_shared")


def agree_mapped(config: Any, settings: PluginSettings, dp: Any) -> None:
    """Tier mapped decides nothing (every rank maps the checkpoint itself),
    but its DP peers must have been given the same settings, as ``decide``
    checks them: the same bounded collective, once per engine and group
    (a peer given another tier meets it there, and every member raises the
    same PluginError naming the setting)."""
    state = engine(config)
    key = tuple(dp.ranks) if dp is not None and hasattr(dp, "ranks") else (id(dp),)
    if key not in state.decisions:
        agree(dp, {"settings": asdict(settings), "service": None, "here": (True, (), "")})
        state.decisions[key] = Decision("independent")


def agree(dp: Any, mine: dict) -> list[dict]:
    """Every DP peer's ``mine`` (one bounded collective over ``dp``), after
    checking that they were given the same settings: else every member
    raises the same PluginError naming the settings that differ."""
    if dp is None or dp.world_size <= 1:
        return [mine]
    from ...groups.group import as_group

    group = as_group(dp, timeout_s=AGREE_TIMEOUT_S)
    answers = group.all_gather(mine, "numa_engram: the DP replicas' plugin settings")
    differ = sorted({key for a in answers for key, value in a["settings"].items()
                     if value != answers[0]["settings"][key]})
    if differ:
        given = "; ".join(f"{key}: " + ", ".join(
            f"rank {rank} {a['settings'][key]!r}" for rank, a in zip(group.ranks, answers))
            for key in differ)
        raise PluginError(f"the DP replicas were given different numa_engram settings ({given})"
                          ": give every replica the same --additional-config")
    return answers


def share_here(settings: PluginSettings) -> tuple[bool, tuple[Any, ...], str]:
    """(ok, where: boot id, uid, directory identity, why not) of this rank
    for one shared copy.  No room is asked of the directory: a 4 KiB copy
    is a memfd its members hand over (the directory holds only the
    hand-over sockets) and the table's create checks memory and huge-page
    pools itself, failing every member alike."""
    from ...host import procfs

    directory = settings.directory or DEFAULT_DIRECTORY
    try:
        st = os.stat(directory)
    except OSError as exc:
        return False, (), f"{directory}: {exc.strerror}"
    return True, (procfs.boot_id(), os.geteuid(), st.st_dev, st.st_ino), ""


def sharing_group(config: Any, settings: PluginSettings, dp: Any, *, tp_rank: int,
                  device: int | None) -> Any:
    """The peers of ``dp`` that share this rank's copy (measured: host,
    uid and directory; split by their GPU's socket with copies="socket"),
    once per engine; None where no peer can (the caller makes a private
    table: logged as every fall back is)."""
    from ...groups.group import sharing_groups

    state = engine(config)
    key = (tuple(dp.ranks) if hasattr(dp, "ranks") else id(dp), settings.copies)
    if key not in state.groups:
        group = sharing_groups(dp, tp_rank=tp_rank, device=device,
                               per_socket=settings.copies == "socket",
                               directory=settings.directory or DEFAULT_DIRECTORY)
        if group.size == 1:
            log.warning(FALL_BACK, f"no DP peer of this rank can map its copy: {group.identity}")
        state.groups[key] = group if group.size > 1 else None
    return state.groups[key]


def device() -> int | None:
    """The rank's CUDA device for registration, None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()
