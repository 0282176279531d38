"""Where a process really is, as far as sharing a table file goes: the one
identity record that ``sharing_groups`` gathers to form the sharing groups
and the create protocol's join step gathers to check them.  Processes can
map one table file iff their boot id (host), uid and table directory
(st_dev, st_ino) are equal; the hostname is only shown."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..host import procfs
from ..store.directories import describe_device, directory_id


@dataclass(frozen=True)
class HostIdentity:
    boot_id: str  # hex
    uid: int
    directory: tuple[int, int] | None  # of the table directory; None: none there
    hostname: str

    @classmethod
    def here(cls, directory: str | None) -> HostIdentity:
        """This process's, for table directory ``directory``."""
        return cls(procfs.boot_id().hex(), os.geteuid(),
                   directory_id(directory) if directory else None, socket.gethostname())

    def key(self) -> tuple:
        """What must be equal for two processes to map one file."""
        return self.boot_id, self.uid, self.directory

    def describe(self) -> str:
        return (f"boot {self.boot_id[:8]}, uid {self.uid}, "
                f"directory {describe_device(self.directory)}")

    def difference(self, leader: HostIdentity, directory: str | None) -> str:
        """Why this process cannot map the leader's file ('' if it can)."""
        if self.boot_id != leader.boot_id:
            return (f"runs on another host (boot id differs; host {self.hostname!r} vs "
                    f"{leader.hostname!r})")
        if self.uid != leader.uid:
            return f"runs as uid {self.uid}, the leader as uid {leader.uid}"
        if self.directory != leader.directory:
            return (f"has another {directory} ({describe_device(self.directory)} vs "
                    f"{describe_device(leader.directory)})")
        return ""

    def report(self, directory: str | None) -> dict:
        """What a deployment log records of the group's identity."""
        return {"boot_id": self.boot_id, "uid": self.uid, "directory": directory,
                "directory_device": None if self.directory is None else
                describe_device(self.directory), "host": self.hostname}


NOWHERE = HostIdentity("", -1, None, "")  # a member that is no process (a placement's reader)
