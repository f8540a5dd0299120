"""Who will finish a pending snapshot, and whether that process is still there.

A snapshot is `pending` from the moment its execution is written until the kernel (a note such
as `unchanged` or `coalesced`) or its snapshot child (the variables) resolves it. Each pending
execution names the process that will resolve it (`executions.snapshot_owner`): the kernel at
first, the snapshot child once it runs. When that process is gone, nobody will: a sweep
(TrajectoryStore.sweep_pending_snapshots) marks the snapshot `failed` with the reason.

An identity is `role|host|boot|pid|start`: the host name; the boot (Linux: the boot id and the
pid namespace, so that a pid is compared only with pids of the same machine, boot and
container); and the process's start time, so that a pid reused by another process is not
mistaken for the owner. A process on another host, boot or namespace cannot be checked from
here: its snapshots are left as they are.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache

ALIVE = "alive"
GONE = "gone"
UNKNOWN = "unknown"  # another host, boot or pid namespace: not ours to judge


@lru_cache(maxsize=1)
def _boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        pass
    try:
        import psutil

        return f"boot@{psutil.boot_time():.0f}"
    except Exception:
        return ""


def _start(pid: int) -> tuple[str, bool] | None:
    """(start time, is a zombie) of a process, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # The command name (field 2) may hold spaces and parentheses: fields after its last ')'.
        fields = stat[stat.rindex(b")") + 2 :].split()
        return fields[19].decode(), fields[0] in (b"Z", b"X")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        proc = psutil.Process(pid)
        return f"{proc.create_time():.2f}", proc.status() == psutil.STATUS_ZOMBIE
    except Exception as e:  # psutil.NoSuchProcess, or psutil missing
        if type(e).__name__ == "NoSuchProcess":
            return None
        raise


def process_identity(role: str, pid: int | None = None) -> str | None:
    """The identity of process `pid` (default: this one) in the role `kernel` or `snapshot`;
    None where it cannot be told."""
    pid = os.getpid() if pid is None else pid
    try:
        found = _start(pid)
    except Exception:
        return None
    boot = _boot()
    if found is None or not boot:
        return None
    return f"{role}|{socket.gethostname()}|{boot}|{pid}|{found[0]}"


def process_state(identity: str | None) -> str:
    """ALIVE, GONE (no such process, a zombie, or another process under the pid), or UNKNOWN."""
    try:
        _role, host, boot, pid, start = (identity or "").split("|")
        number = int(pid)
    except ValueError:
        return UNKNOWN
    if host != socket.gethostname() or boot != _boot():
        return UNKNOWN
    try:
        found = _start(number)
    except Exception:
        return UNKNOWN
    if found is None or found[0] != start or found[1]:
        return GONE
    return ALIVE


def describe(identity: str) -> str:
    """'the kernel (pid 123)' / 'the snapshot process (pid 456)'."""
    parts = identity.split("|")
    role = {"kernel": "the kernel", "snapshot": "the snapshot process"}.get(parts[0], parts[0])
    return f"{role} (pid {parts[3]})" if len(parts) == 5 else role
