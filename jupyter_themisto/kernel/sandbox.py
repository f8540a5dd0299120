"""Locks a forked preview child down before it runs user code: rlimits, no-new-privs, Landlock
(no file writes, creations, deletions, renames) and seccomp (no processes, no network, no
writes to inherited descriptors), plus audit hooks that name what a cell tried.

Everything here runs in the child only; each layer reports "on" or "unavailable: <why>".
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import sys
from typing import Any

try:  # the bindings are loaded in the kernel, before a fork, so the child reads no files
    import landlock
except Exception as e:  # pragma: no cover - depends on the platform
    landlock = None
    _LANDLOCK_IMPORT_ERROR = f"{type(e).__name__}: {e}"
try:
    import pyseccomp
except Exception as e:  # pragma: no cover - depends on the platform (libseccomp missing)
    pyseccomp = None
    _SECCOMP_IMPORT_ERROR = f"{type(e).__name__}: {e}"

PR_SET_NO_NEW_PRIVS = 38
CLONE_THREAD = 0x00010000

#: syscalls that start a process or run a program
_PROCESS_SYSCALLS = ("fork", "vfork", "execve", "execveat")
#: syscalls that reach another endpoint (the pipe back uses write(2), not these)
_NETWORK_SYSCALLS = (
    "connect",
    "bind",
    "listen",
    "accept",
    "accept4",
    "sendto",
    "sendmsg",
    "sendmmsg",
)
#: write through descriptors opened before the lockdown (Landlock only checks new opens)
_FD_WRITE_SYSCALLS = ("write", "pwrite64", "writev", "pwritev", "pwritev2")
#: other ways to change the world outside the child (Landlock does not cover metadata, and the
#: kernel may run as root)
_OTHER_SYSCALLS = (
    "ftruncate",
    "fallocate",
    "sendfile",
    "splice",
    "tee",
    "vmsplice",
    "copy_file_range",
    "io_uring_setup",
    "chmod",
    "fchmod",
    "fchmodat",
    "chown",
    "fchown",
    "lchown",
    "fchownat",
    "utime",
    "utimes",
    "utimensat",
    "futimesat",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
    "ptrace",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "reboot",
    "swapon",
    "swapoff",
    "sethostname",
    "setdomainname",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "unshare",
    "setns",
    "msgsnd",
    "mq_timedsend",
)


def _set_no_new_privs() -> str:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return f"unavailable: prctl failed ({os.strerror(ctypes.get_errno())})"
        return "on"
    except Exception as e:
        return f"unavailable: {e}"


def _landlock() -> str:
    if landlock is None:
        return f"unavailable: {_LANDLOCK_IMPORT_ERROR}"
    try:
        abi = landlock.landlock_abi_version()
        fs = landlock.FSAccess
        # Read and execute everywhere; every other access right is handled and so denied.
        ruleset = landlock.Ruleset()
        ruleset.allow("/", rules=fs.READ_FILE | fs.READ_DIR | fs.EXECUTE)
        ruleset.apply()
        return f"on (ABI {abi})"
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {e}"


def _seccomp(max_fd: int) -> str:
    if pyseccomp is None:
        return f"unavailable: {_SECCOMP_IMPORT_ERROR}"
    sc = pyseccomp
    try:
        f = sc.SyscallFilter(defaction=sc.ALLOW)
        deny = sc.ERRNO(errno.EPERM)
        skipped = []

        def rule(action: int, name: str, *args: Any) -> None:
            try:
                f.add_rule(action, name, *args)
            except Exception:  # a syscall this architecture does not have
                skipped.append(name)

        for name in _PROCESS_SYSCALLS + _NETWORK_SYSCALLS + _OTHER_SYSCALLS:
            rule(deny, name)
        # Threads are processes to clone(2): allow only those sharing this one's thread group.
        rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
        # clone3 passes its flags in memory seccomp cannot read: ENOSYS makes glibc use clone.
        rule(sc.ERRNO(errno.ENOSYS), "clone3")
        # One comparison per argument: the writable descriptors are the lowest ones.
        for name in _FD_WRITE_SYSCALLS:
            rule(deny, name, sc.Arg(0, sc.GT, max_fd))
        pid = os.getpid()
        for name in ("kill", "tgkill"):
            rule(deny, name, sc.Arg(0, sc.NE, pid))
        rule(deny, "tkill")
        f.load()
        return "on" if not skipped else f"on (not on this architecture: {', '.join(skipped)})"
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {e}"


def private_memory(pid: int) -> int | None:
    """Bytes of memory `pid` holds privately (its own allocations and the copy-on-write pages
    it copied), or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            total = 0
            for line in fh:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
            return total
    except (OSError, ValueError):
        return None


#: the layers a preview never runs without: they stop what the audit hooks cannot see (C code)
REQUIRED_LAYERS = ("landlock", "seccomp")


def missing_layers(state: dict[str, str]) -> list[str]:
    """The required layers `lock_down` could not put in place, with the reason for each."""
    return [
        f"{name} ({state.get(name, 'not tried')})"
        for name in REQUIRED_LAYERS
        if not state.get(name, "").startswith("on")
    ]


def lock_down(*, max_fd: int, cpu_seconds: int) -> dict[str, str]:
    """Restrict the calling (forked) process for good; returns each layer's state.

    Only descriptors 0..`max_fd` stay writable (the caller points them at /dev/null and at
    its pipe); `cpu_seconds` bounds the child's CPU time. Memory is
    bounded by the parent, which watches `private_memory` of the child: rlimits on the
    address space or data segment break allocators that reserve large ranges up front
    (Arrow's jemalloc fails its first malloc under them).
    """
    state: dict[str, str] = {}
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        state["cpu"] = f"on ({cpu_seconds} s)"
    except Exception as e:
        state["cpu"] = f"unavailable: {e}"
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    except Exception:
        pass  # seccomp is the real barrier; as root RLIMIT_NPROC is not enforced anyway
    state["no_new_privs"] = _set_no_new_privs()
    state["landlock"] = _landlock()
    state["seccomp"] = _seccomp(max_fd)
    return state


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

_PATH_EVENTS = {
    "os.remove": "delete",
    "os.rmdir": "delete",
    "shutil.rmtree": "delete",
    "os.mkdir": "create",
    "os.truncate": "write",
    "os.chmod": "change the permissions of",
    "os.chown": "change the owner of",
    "os.utime": "change the times of",
    "os.link": "link",
    "os.symlink": "link",
    "os.setxattr": "change the attributes of",
    "os.removexattr": "change the attributes of",
}
_PROCESS_EVENTS = (
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "pty.spawn",
    "os.startfile",
)
_NETWORK_EVENTS = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")


class PreviewStopped(BaseException):
    """Raised into the cell when it tries a side effect (BaseException: `except Exception`
    in the cell must not swallow it)."""


def describe_event(event: str, args: tuple[Any, ...]) -> str | None:
    """What a Python audit event would do outside the child, in words; None if harmless."""
    try:
        if event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            writes = bool(flags and flags & _WRITE_FLAGS) or bool(
                isinstance(mode, str) and set(mode) & set("wax+")
            )
            if writes and isinstance(path, (str, bytes, os.PathLike)):
                return f"write {os.fsdecode(path)}"
            return None
        if event in _PATH_EVENTS:
            return f"{_PATH_EVENTS[event]} {os.fsdecode(args[0])}"
        if event == "os.rename":
            return f"rename {os.fsdecode(args[0])} to {os.fsdecode(args[1])}"
        if event in _NETWORK_EVENTS:
            address = args[1] if len(args) > 1 else None
            if event == "socket.bind":
                return f"listen on the network ({address!r})"
            return f"open a network connection ({address!r})"
        if event in _PROCESS_EVENTS:
            if event == "subprocess.Popen" and len(args) > 1:
                what = args[1]
            else:
                what = args[0] if args else None
            if isinstance(what, (list, tuple)):
                what = " ".join(os.fsdecode(a) for a in what)
            return f"start a process ({what})" if what not in (None, "") else "start a process"
        if event == "os.kill" and args and args[0] != os.getpid():
            return f"send a signal to process {args[0]}"
    except Exception:
        return f"do {event}"
    return None


def install_audit_hook(stopped: list[str]) -> None:
    """Name each side effect the cell tries in `stopped`, and stop the cell there."""

    def hook(event: str, args: tuple[Any, ...]) -> None:
        what = describe_event(event, args)
        if what is not None:
            stopped.append(what)
            raise PreviewStopped(f"preview stopped: the cell would {what}")

    sys.addaudithook(hook)
