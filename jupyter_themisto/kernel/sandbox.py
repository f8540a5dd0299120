"""Isolates a forked preview child from everything outside it, by construction rather than by
listing dangerous calls: new user, mount, network, IPC, PID and UTS namespaces; a private
copy-on-write root (see `private_root`); no descriptor or shared mapping in common with the kernel
except the reply channel; no capability; Landlock with every right the running kernel knows; a
seccomp allow-list; resource bounds. Plus the audit hooks and handle stubs that name what a cell
tried when it reached for the world outside.

Everything but `seccomp_program` and `namespace_memory` runs in the child. A layer the running
Linux lacks raises `Unavailable` with the reason, and the cell does not run.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import os
import resource
import signal
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from . import private_root
from ._linux import check, libc, prctl, syscall

try:
    import pyseccomp
except Exception as e:  # pragma: no cover - depends on the platform (libseccomp missing)
    pyseccomp = None
    _SECCOMP_IMPORT_ERROR = f"{type(e).__name__}: {e}"


class Unavailable(Exception):
    """The running Linux lacks something the sandbox needs; the message says what."""


class PreviewStopped(BaseException):
    """Raised into the cell when it reaches for the world outside the preview (BaseException:
    `except Exception` in the cell must not swallow it)."""


# -- namespaces -------------------------------------------------------------------------------

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWCGROUP = 0x02000000
CLONE_THREAD = 0x00010000
_NAMESPACES = (
    CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID
)


def enter_namespaces() -> None:
    """Move the calling (forked, single-threaded) process into new user, mount, network, IPC and
    UTS namespaces; its next child is the first process of a new PID namespace.

    The user namespace maps only the kernel's own uid and gid onto themselves: files keep their
    owners, and the process is the same user as the kernel — with capabilities over its new
    namespaces only (dropped before the cell runs), none over the kernel's.
    """
    uid, gid = os.geteuid(), os.getegid()
    try:
        check(libc.unshare(_NAMESPACES), "unshare")
    except OSError as e:
        raise Unavailable(
            f"new user, mount, network, IPC, PID and UTS namespaces ({os.strerror(e.errno or 0)})"
        ) from None
    _map_user(uid, gid)


def _map_user(uid: int, gid: int) -> None:
    for name, value in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        try:
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(value)
        except OSError as e:
            raise Unavailable(
                f"a user namespace map ({name}: {os.strerror(e.errno or 0)})"
            ) from None


#: the namespaces a kernel with CAP_SYS_ADMIN (root) makes for its preview from its own thread
#: (see `fork_into_namespaces`); the preview adds its mount and user namespaces itself
_DIRECT_NAMESPACES = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
_DIRECT_FILES = ("net", "ipc", "uts", "pid_for_children")
#: why `fork_into_namespaces` is not possible in this kernel (learnt once)
direct_unavailable: str | None = None


def fork_into_namespaces() -> tuple[int, int]:
    """The single fork of a kernel that may create namespaces itself (root, CAP_SYS_ADMIN): the
    calling thread moves into new PID, network, IPC and UTS namespaces, forks the preview's first
    process into them, and moves back; the kernel's other threads never leave theirs. Returns
    (pid, a descriptor of the new IPC namespace's System V shared memory table) in the kernel,
    (0, -1) in the child. Raises `Unavailable` (and remembers why) where Linux refuses; the
    caller then takes the unprivileged way (a monitor that enters a user namespace first)."""
    global direct_unavailable
    if direct_unavailable is not None:
        raise Unavailable(direct_unavailable)
    home: dict[str, int] = {}
    pid, sysv = -1, -1
    try:
        for name in _DIRECT_FILES:
            home[name] = os.open(f"/proc/thread-self/ns/{name}", os.O_RDONLY | os.O_CLOEXEC)
            # The way back must be open before the thread leaves (a container may allow
            # unshare and refuse setns).
            if libc.setns(home[name], 0) != 0:
                direct_unavailable = f"setns {name}: {os.strerror(ctypes.get_errno())}"
                raise Unavailable(direct_unavailable)
        if libc.unshare(_DIRECT_NAMESPACES) != 0:
            direct_unavailable = f"unshare: {os.strerror(ctypes.get_errno())}"
            raise Unavailable(direct_unavailable)
        try:
            # (the table of the namespace the descriptor was opened in, whoever reads it)
            sysv = os.open("/proc/sysvipc/shm", os.O_RDONLY | os.O_CLOEXEC)
            pid = os.fork()
        finally:
            if pid != 0:
                for name in _DIRECT_FILES:
                    if libc.setns(home[name], 0) != 0:  # (never fails for the namespace it left)
                        err = ctypes.get_errno()
                        os.write(2, f"themisto: setns back {name}: {os.strerror(err)}\n".encode())
                        os._exit(70)  # a kernel outside its namespaces must not go on
    finally:
        if pid != 0:
            for fd in home.values():
                os.close(fd)
            if pid < 0 and sysv >= 0:
                os.close(sysv)
    if pid == 0:
        for fd in (*home.values(), sysv):
            os.close(fd)
        return 0, -1
    return pid, sysv


def pid_max_per_namespace() -> bool:
    """Whether this Linux keeps kernel/pid_max per PID namespace (>= 6.14): elsewhere it is the
    whole machine's setting, which a privileged preview must never write."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 14)


def enter_user_namespace() -> None:
    """For a first process made by `fork_into_namespaces` once its root is built: a new user
    namespace mapping only its own uid and gid. It then holds capabilities over that namespace
    only, which owns none of its other namespaces (nor the kernel's)."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        check(libc.unshare(CLONE_NEWUSER), "unshare")
    except OSError as e:
        raise Unavailable(f"a new user namespace ({os.strerror(e.errno or 0)})") from None
    _map_user(uid, gid)


# -- descriptors ------------------------------------------------------------------------------


@dataclass
class Descriptor:
    """One descriptor the child inherited from the kernel, as it was before the child moved."""

    fd: int
    target: str
    kind: str  # "reopen", "copy" or what the stub stands for ("socket", "pipe", "file open…")
    flags: int = 0
    offset: int = 0
    size: int = 0
    mtime_ns: int = 0


def _describe(target: str, mode: int, flags: int) -> str:
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if not target:
        return "a handle"
    if stat.S_ISREG(mode) and flags & os.O_ACCMODE != os.O_RDONLY:
        return f"a file open for writing ({target})"
    if target.endswith(" (deleted)"):
        return f"a deleted file ({target[: -len(' (deleted)')]})"
    return f"a handle ({target})"


#: the largest file open for writing that a preview gets a private copy of (bytes): the copy
#: is made when the preview starts (overlayfs copies the whole file up) and lives in its memory
COPY_LIMIT = 64 * 2**20


def inventory_descriptors(keep: set[int], copy: Collection[int] = ()) -> list[Descriptor]:
    """Every descriptor but `keep`: the read-only files and directories to re-open in the
    private root (at their offset); the regular files open for writing among `copy` (the
    person's own handles) to re-open there too, writable — the overlay gives the preview its own
    copy, the real file is untouched; and the rest to replace by stubs."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep:
            continue
        try:
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                # A socket, pipe, device or anonymous inode: a stub, whatever it is.
                found.append(Descriptor(fd, "", _describe("", st.st_mode, 0)))
                continue
            target = os.readlink(f"/proc/self/fd/{fd}")
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                flags |= os.O_CLOEXEC
        except OSError:
            continue  # (the descriptor listdir itself used)
        readable_file = (
            target.startswith("/")
            and not target.endswith(" (deleted)")
            and flags & os.O_ACCMODE == os.O_RDONLY
        )
        writable_copy = (
            fd in copy
            and stat.S_ISREG(st.st_mode)
            and target.startswith("/")
            and not target.endswith(" (deleted)")
            and flags & os.O_ACCMODE != os.O_RDONLY
            and not flags & os.O_PATH
            and st.st_size <= COPY_LIMIT
        )
        if readable_file or writable_copy:
            try:
                offset = os.lseek(fd, 0, os.SEEK_CUR)
            except OSError:
                offset = 0  # an O_PATH descriptor
            kind = "reopen" if readable_file else "copy"
            found.append(Descriptor(fd, target, kind, flags, offset, st.st_size, st.st_mtime_ns))
        else:
            found.append(Descriptor(fd, target, _describe(target, st.st_mode, flags), flags))
    return found


_REOPEN_FLAGS = os.O_ACCMODE | os.O_DIRECTORY | os.O_PATH | os.O_NOATIME
#: what a private copy keeps of the kernel's file's flags (never O_CREAT, O_TRUNC, O_EXCL)
_COPY_FLAGS = os.O_ACCMODE | os.O_APPEND | os.O_NOATIME | os.O_SYNC | os.O_DSYNC


def replace_descriptors(found: list[Descriptor]) -> dict[int, str]:
    """In the private root: re-open each read-only file at its offset onto the same descriptor
    number (reads work; the kernel's offset does not move), each file to copy writable (the
    overlay copies it up: writes, truncation, locks and mappings reach the copy only), and put a
    stub (an O_PATH descriptor of /dev/null: every read, write, mapping or socket call on it
    fails) in place of every other. Returns the stubbed descriptors with what each stood for."""
    stub = os.open("/dev/null", os.O_PATH | os.O_CLOEXEC)
    stubbed = {}
    try:
        for d in found:
            inheritable = not d.flags & os.O_CLOEXEC
            if d.kind in ("reopen", "copy"):
                keep = _REOPEN_FLAGS if d.kind == "reopen" else _COPY_FLAGS
                try:
                    new = os.open(d.target, (d.flags & keep) | os.O_CLOEXEC | os.O_NOCTTY)
                    try:
                        st = os.fstat(new)
                        if stat.S_ISREG(st.st_mode) and (
                            st.st_size != d.size or st.st_mtime_ns != d.mtime_ns
                        ):
                            raise OSError(errno.ESTALE, "not the same file any more")
                        if d.offset:
                            os.lseek(new, d.offset, os.SEEK_SET)
                        os.dup2(new, d.fd, inheritable=inheritable)
                    finally:
                        os.close(new)
                    continue
                except OSError:
                    d.kind = (
                        f"a file ({d.target}) that could not be re-opened"
                        if d.kind == "reopen"
                        else f"a file open for writing ({d.target}) that could not be copied"
                    )
            os.dup2(stub, d.fd, inheritable=False)
            stubbed[d.fd] = d.kind
    finally:
        os.close(stub)
    return stubbed


# -- shared mappings --------------------------------------------------------------------------

PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x02, 0x10, 0x20
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _ProcmapQuery(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint64),
        ("query_flags", ctypes.c_uint64),
        ("query_addr", ctypes.c_uint64),
        ("vma_start", ctypes.c_uint64),
        ("vma_end", ctypes.c_uint64),
        ("vma_flags", ctypes.c_uint64),
        ("vma_page_size", ctypes.c_uint64),
        ("vma_offset", ctypes.c_uint64),
        ("inode", ctypes.c_uint64),
        ("dev_major", ctypes.c_uint32),
        ("dev_minor", ctypes.c_uint32),
        ("vma_name_size", ctypes.c_uint32),
        ("build_id_size", ctypes.c_uint32),
        ("vma_name_addr", ctypes.c_uint64),
        ("build_id_addr", ctypes.c_uint64),
    ]


PROCMAP_QUERY = 0xC0686611  # _IOWR('f', 17, struct procmap_query), Linux >= 6.11
_VMA_READ, _VMA_WRITE, _VMA_EXEC, _VMA_SHARED, _VMA_COVERING_OR_NEXT = 1, 2, 4, 8, 0x10


@dataclass
class _Mapping:
    start: int
    end: int
    prot: int
    offset: int
    dev: int
    inode: int
    path: str


def _shared_mappings() -> list[_Mapping]:
    """The process's shared mappings: asked one by one where Linux answers PROCMAP_QUERY
    (much faster than formatting all of /proc/self/maps), else read from /proc/self/maps."""
    found: list[_Mapping] = []
    with open("/proc/self/maps", "rb", buffering=0) as fh:
        name = ctypes.create_string_buffer(4096)
        q = _ProcmapQuery()
        addr = 0
        while True:
            ctypes.memset(ctypes.byref(q), 0, ctypes.sizeof(q))
            q.size = ctypes.sizeof(q)
            q.query_flags = _VMA_COVERING_OR_NEXT | _VMA_SHARED
            q.query_addr = addr
            q.vma_name_size, q.vma_name_addr = len(name), ctypes.addressof(name)
            if libc.ioctl(fh.fileno(), ctypes.c_ulong(PROCMAP_QUERY), ctypes.byref(q)) != 0:
                err = ctypes.get_errno()
                if err == errno.ENOENT:
                    return found  # no shared mapping above addr
                break  # an older Linux: read the text
            prot = q.vma_flags & (_VMA_READ | _VMA_WRITE | _VMA_EXEC)  # the same bits as PROT_*
            path = name.value.decode(errors="replace") if q.vma_name_size else ""
            found.append(
                _Mapping(
                    q.vma_start,
                    q.vma_end,
                    prot,
                    q.vma_offset,
                    os.makedev(q.dev_major, q.dev_minor),
                    q.inode,
                    path,
                )
            )
            addr = q.vma_end
        found = []
        fh.seek(0)
        for line in fh.read().decode(errors="replace").splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) < 5 or parts[1][3] != "s":
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            perms = parts[1]
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            prot = (
                (PROT_READ if perms[0] == "r" else 0)
                | (PROT_WRITE if perms[1] == "w" else 0)
                | (PROT_EXEC if perms[2] == "x" else 0)
            )
            path = parts[5].strip() if len(parts) > 5 else ""
            found.append(
                _Mapping(
                    start,
                    end,
                    prot,
                    int(parts[2], 16),
                    os.makedev(major, minor),
                    int(parts[4]),
                    path,
                )
            )
    return found


def privatize_shared_mappings(limit: int) -> int:
    """Turn every shared mapping inherited from the kernel (a `numpy.memmap` in r+ mode,
    multiprocessing shared memory, System V segments) into a private copy-on-write one with the
    same content at the same address, so that writes through it stay in the child. Returns the
    bytes copied (file mappings are re-mapped from the file, not copied)."""
    copied = 0
    for m in _shared_mappings():
        length = m.end - m.start
        fd = -1
        if m.path.startswith("/") and m.inode:
            try:
                fd = os.open(m.path, os.O_RDONLY | os.O_CLOEXEC)
                st = os.fstat(fd)
                if st.st_ino != m.inode or st.st_dev != m.dev:
                    os.close(fd)
                    fd = -1
            except OSError:
                fd = -1
        if fd >= 0:
            try:
                got = libc.mmap(m.start, length, m.prot, MAP_PRIVATE | MAP_FIXED, fd, m.offset)
            finally:
                os.close(fd)
            if got != m.start:
                raise Unavailable(f"a private copy of the shared mapping of {m.path}")
            continue
        copied += length
        if copied > limit:
            raise Unavailable(f"room to copy the kernel's shared memory ({copied >> 20} MB)")
        data = ctypes.string_at(m.start, length) if m.prot & PROT_READ else None
        got = libc.mmap(
            m.start, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0
        )
        if got != m.start:
            raise Unavailable(f"a private copy of the shared memory {m.path or hex(m.start)}")
        if data is not None:
            ctypes.memmove(m.start, data, length)
        check(libc.mprotect(m.start, length, m.prot), "mprotect")
    return copied


# -- capabilities and limits ------------------------------------------------------------------

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
#: noroot, no_setuid_fixup, no_cap_ambient_raise, each locked, and keep_caps locked off
_SECUREBITS = 0b11101111


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities() -> str:
    """Give up every capability (over the child's own namespaces: it never had any over the
    kernel's), for good: not regained by running a program, even as uid 0."""
    prctl(PR_SET_SECUREBITS, _SECUREBITS)
    with open("/proc/sys/kernel/cap_last_cap") as fh:
        last = int(fh.read())
    for cap in range(last + 1):
        prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    check(libc.capset(ctypes.byref(header), data), "capset")
    with open("/proc/self/status") as fh:
        caps = {
            k: v.strip() for k, v in (line.split(":", 1) for line in fh if line.startswith("Cap"))
        }
    if any(int(caps.get(k, "1"), 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")):
        raise Unavailable(f"dropping every capability (left: {caps})")
    return "on (none left, not regained by exec)"


def _lower_limit(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def set_limits(cpu_seconds: int) -> str:
    # Soft limit: SIGXCPU, which the kernel reports; the hard one a second later: SIGKILL.
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        cpu_seconds = min(cpu_seconds, hard - 1)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    # A crash dumps no core (RLIMIT_CORE 1 refuses piped core handlers too).
    _lower_limit(resource.RLIMIT_CORE, 1)
    # POSIX message queues are charged to the user, not to the namespace.
    _lower_limit(resource.RLIMIT_MSGQUEUE, 1 << 18)
    return f"on ({cpu_seconds} s of CPU)"


def namespace_sysctls(memory_bytes: int) -> dict[str, str]:
    """Bounds of the child's own namespaces (written in its /proc/sys before it is read-only)."""
    pages = max(1, memory_bytes // os.sysconf("SC_PAGE_SIZE"))
    return {
        # at most this many processes and threads (Linux >= 6.14: pid_max per PID namespace)
        "kernel/pid_max": "512",
        "kernel/shmall": str(pages),
        "kernel/shmmax": str(memory_bytes),
        "kernel/shmmni": "64",
        "kernel/msgmni": "16",
        "kernel/msgmnb": "65536",
        "kernel/sem": "250 4000 32 16",
        "fs/mqueue/queues_max": "16",
    }


# -- Landlock ---------------------------------------------------------------------------------

SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
#: the file-system rights each ABI version knows (every one is handled, hence denied by default)
_FS_RIGHTS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
#: the highest ABI whose rights this module knows
LANDLOCK_KNOWN_ABI = 7


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The Landlock ABI version of the running kernel; 0 where Landlock is off or absent."""
    abi = syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    return max(abi, 0)


def apply_landlock(root: private_root.PrivateRoot) -> str:
    """Handle every access right the running ABI knows and grant back only: reading and running
    files everywhere; changing the overlays (the cell's private copies); using the few devices
    of the private /dev and its own terminal. No TCP bind or connect at all, no signal and no
    abstract unix socket outside the child's own domain."""
    abi = landlock_abi()
    if abi < 1:
        raise Unavailable("Landlock (Linux >= 5.13 with Landlock enabled)")
    fs = _FS_RIGHTS[max(k for k in _FS_RIGHTS if k <= abi)]
    attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0, 0)
    if abi >= 6:
        attr.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = check(
        syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0),
        "landlock_create_ruleset",
    )
    try:
        rules = [("/", FS_EXECUTE | FS_READ_FILE | FS_READ_DIR)]
        rules += [(path, fs) for path in root.writable]
        dev = FS_READ_FILE | FS_WRITE_FILE | (fs & FS_TRUNCATE)
        rules += [(path, dev) for path in root.devices]
        rules.append(("/dev/pts", dev | FS_READ_DIR | (fs & FS_IOCTL_DEV)))
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= _FILE_RIGHTS
                rule = _PathBeneath(access, fd)
                check(
                    syscall(
                        SYS_LANDLOCK_ADD_RULE,
                        ruleset,
                        LANDLOCK_RULE_PATH_BENEATH,
                        ctypes.byref(rule),
                        0,
                    ),
                    f"landlock_add_rule {path}",
                )
            finally:
                os.close(fd)
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        check(syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    parts = ["files" + (", truncate" if abi >= 3 else "") + (", device ioctls" if abi >= 5 else "")]
    if abi >= 4:
        parts.append("TCP bind/connect")
    if abi >= 6:
        parts.append("signals, abstract unix sockets")
    known = "" if abi <= LANDLOCK_KNOWN_ABI else f"; rights known up to ABI {LANDLOCK_KNOWN_ABI}"
    return f"on (ABI {abi}: {', '.join(parts)}{known})"


# -- seccomp ----------------------------------------------------------------------------------

#: what a Python computation needs (numpy, pandas, matplotlib, threads, subprocesses, System V
#: and POSIX IPC, which die with the preview's IPC namespace); anything else fails with EPERM.
#: Names unknown on an architecture are skipped.
_ALLOWED = """
read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 lseek close close_range
open openat openat2 creat stat fstat lstat newfstatat statx fstatfs statfs access faccessat
faccessat2 getdents getdents64 readlink readlinkat getcwd chdir fchdir mkdir mkdirat rmdir unlink
unlinkat rename renameat renameat2 link linkat symlink symlinkat chmod fchmod fchmodat fchmodat2
chown fchown lchown fchownat utime utimes utimensat futimesat truncate ftruncate fallocate fsync
fdatasync sync_file_range fadvise64 readahead flock dup dup2 dup3 pipe pipe2 mknod mknodat
umask getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr setxattr lsetxattr fsetxattr
removexattr lremovexattr fremovexattr getxattrat listxattrat setxattrat removexattrat sendfile
splice tee copy_file_range memfd_create
brk mmap munmap mremap mprotect madvise mlock mlock2 munlock munlockall mincore msync membarrier
mbind get_mempolicy set_mempolicy pkey_alloc pkey_free pkey_mprotect mseal
exit exit_group wait4 waitid kill tkill tgkill rt_sigaction rt_sigprocmask rt_sigreturn
rt_sigpending rt_sigtimedwait rt_sigsuspend rt_sigqueueinfo rt_tgsigqueueinfo sigaltstack
getpid getppid gettid getuid geteuid getgid getegid getgroups getresuid getresgid getpgid getpgrp
getsid setsid setpgid capget arch_prctl set_tid_address set_robust_list rseq futex futex_waitv
futex_wait futex_wake futex_requeue sched_yield sched_getaffinity sched_setaffinity
sched_getparam sched_getscheduler sched_get_priority_max sched_get_priority_min
sched_rr_get_interval sched_getattr getpriority setpriority getrlimit setrlimit prlimit64
getrusage times sysinfo uname nanosleep clock_nanosleep clock_gettime clock_getres gettimeofday
time alarm pause getitimer setitimer timer_create timer_settime timer_gettime timer_getoverrun
timer_delete timerfd_create timerfd_settime timerfd_gettime eventfd eventfd2 signalfd signalfd4
epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2 poll ppoll select
pselect6 getrandom restart_syscall ioprio_get getcpu
listen accept accept4 getsockname getpeername getsockopt setsockopt shutdown recvfrom recvmsg
recvmmsg
shmget shmat shmdt shmctl semget semop semtimedop semctl msgget msgsnd msgrcv msgctl mq_open
mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr
"""
#: starting processes and running programs (only where the PID namespace bounds their number)
_PROCESSES = "fork vfork execve execveat"
#: prctl options a program may use on itself
_PRCTL = (
    1,  # PR_SET_PDEATHSIG
    2,  # PR_GET_PDEATHSIG
    3,  # PR_GET_DUMPABLE
    15,  # PR_SET_NAME
    16,  # PR_GET_NAME
    21,  # PR_GET_SECCOMP
    23,  # PR_CAPBSET_READ
    27,  # PR_GET_SECUREBITS
    29,  # PR_SET_TIMERSLACK
    30,  # PR_GET_TIMERSLACK
    36,  # PR_SET_CHILD_SUBREAPER
    37,  # PR_GET_CHILD_SUBREAPER
    38,  # PR_SET_NO_NEW_PRIVS
    39,  # PR_GET_NO_NEW_PRIVS
    40,  # PR_GET_TID_ADDRESS
    42,  # PR_GET_THP_DISABLE
    47,  # PR_CAP_AMBIENT (reading; raising needs a capability)
    52,  # PR_GET_SPECULATION_CTRL
    0x53564D41,  # PR_SET_VMA (glibc names its mappings)
)
_SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
_NAMESPACE_FLAGS = (
    CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
) | CLONE_NEWCGROUP
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C
_F_SETLEASE = 1024

_programs: dict[bool, bytes] = {}


def seccomp_program(processes: bool) -> bytes:
    """The allow-list as a BPF program (built once per kernel with libseccomp, loaded in each
    child with one prctl). `processes`: may the cell start processes and run programs."""
    if processes in _programs:
        return _programs[processes]
    if pyseccomp is None:
        raise Unavailable(f"seccomp (libseccomp: {_SECCOMP_IMPORT_ERROR})")
    sc = pyseccomp
    f = sc.SyscallFilter(defaction=sc.ERRNO(errno.EPERM))
    allow = sc.ALLOW

    def rule(action: int, name: str, *args: Any) -> None:
        try:
            number = sc.resolve_syscall(sc.system_arch(), name)
        except Exception:
            return  # a system call this architecture (or this libseccomp) does not know
        if number < 0:
            return
        f.add_rule(action, name, *args)

    for name in _ALLOWED.split() + (_PROCESSES.split() if processes else []):
        rule(allow, name)
    for option in _PRCTL:
        rule(allow, "prctl", sc.Arg(0, sc.EQ, option))
    for family in _SOCKET_FAMILIES:
        rule(allow, "socket", sc.Arg(0, sc.EQ, family))
    rule(allow, "socketpair", sc.Arg(0, sc.EQ, socket.AF_UNIX))
    # Any fcntl but a lease: one on a real file (beside a mount point, read-only) would hold
    # up the writers outside until the preview ends.
    rule(allow, "fcntl", sc.Arg(1, sc.NE, _F_SETLEASE))
    # send() with no address: to the peer of a socket pair; never to an address
    rule(allow, "sendto", sc.Arg(4, sc.EQ, 0))
    # Any ioctl but faking terminal input (one comparison per rule: libseccomp's limit).
    rule(allow, "ioctl", sc.Arg(1, sc.LT, _TIOCSTI))
    for request in range(_TIOCSTI + 1, _TIOCLINUX):
        rule(allow, "ioctl", sc.Arg(1, sc.EQ, request))
    rule(allow, "ioctl", sc.Arg(1, sc.GT, _TIOCLINUX))
    if processes:
        rule(allow, "clone", sc.Arg(0, sc.MASKED_EQ, _NAMESPACE_FLAGS, 0))
    else:
        rule(allow, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, CLONE_THREAD))
    # clone3 passes its flags in memory seccomp cannot read: ENOSYS makes glibc use clone.
    rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        _programs[processes] = fh.read()
    return _programs[processes]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp(program: bytes) -> None:
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    prctl(22, 2, ctypes.addressof(prog))  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


# -- the whole lockdown -----------------------------------------------------------------------


@dataclass
class Isolation:
    """What `isolate` put in place: each layer's state (for the reply), the descriptors it
    stubbed, the scratch file system's descriptor, and whether processes may run."""

    state: dict[str, str]
    stubbed: dict[int, str]
    scratch_fd: int
    processes: bool


def isolate(
    *,
    keep: set[int],
    copy: Collection[int] = (),
    memory_mb: int,
    cpu_seconds: int,
    programs: dict[bool, bytes],
    direct: bool = False,
) -> Isolation:
    """Lock the calling process (the first of its PID namespace) down for good; raise
    `Unavailable` if any layer cannot be put in place.

    `keep`: the descriptors that stay (the reply channel); `copy`: the files open for writing
    to give the preview a private copy of (see `inventory_descriptors`); `programs`: the seccomp
    programs built by the kernel for `processes` False and True. `direct`: made by
    `fork_into_namespaces` (still privileged: it enters its mount namespace first and its user
    namespace once the root is built); else by a monitor in `enter_namespaces` (already in its
    user namespace)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the kernel's (or monitor's) death ends it
    os.setsid()  # kill(0, ...) and process-group calls reach this namespace only
    state: dict[str, str] = {
        "namespaces": "on (user, mount, network, IPC, PID, UTS)",
    }
    if direct:
        try:
            check(libc.unshare(CLONE_NEWNS), "unshare")
        except OSError as e:
            raise Unavailable(f"a new mount namespace ({os.strerror(e.errno or 0)})") from None
    found = inventory_descriptors(keep, copy)
    memory = memory_mb * 2**20
    copied = privatize_shared_mappings(memory)
    sysctls = namespace_sysctls(memory)
    refused = {}
    if direct and not pid_max_per_namespace():
        del sysctls["kernel/pid_max"]  # (the machine's own: never written)
        refused["kernel/pid_max"] = "Linux < 6.14 has no pid_max per PID namespace"
    try:
        root, failed = private_root.build(scratch_bytes=memory, sysctls=sysctls, whole=direct)
    except OSError as e:
        raise Unavailable(f"a private copy-on-write root ({e.strerror or e})") from None
    failed.update(refused)
    processes = "kernel/pid_max" not in failed
    state["filesystem"] = "on (private overlay of every file system; writes stay in the preview)"
    if root.read_only:
        state["filesystem"] += f"; read-only: {', '.join(sorted(root.read_only))}"
    stubbed = replace_descriptors(found)
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):  # C code's prints go nowhere (the kernel's streams are stubbed)
        os.dup2(devnull, fd)
        stubbed.pop(fd, None)
    os.close(devnull)
    if direct:
        enter_user_namespace()
    copies = sum(d.kind == "copy" for d in found)
    state["descriptors"] = (
        f"on ({len(stubbed)} stubbed, {len(found) - len(stubbed) - copies} re-opened,"
        f" {copies} copied)"
    )
    state["shared_memory"] = f"on (private copies, {copied >> 10} kB copied)"
    state["processes"] = (
        "on (inside the namespaces, at most 512)"
        if processes
        else f"off: no processes (this Linux cannot bound them: {failed.get('kernel/pid_max')})"
    )
    state["cpu"] = set_limits(cpu_seconds)
    state["capabilities"] = drop_capabilities()
    prctl(PR_SET_DUMPABLE, 1)  # (the kernel reads the child's /proc to bound its memory)
    state["landlock"] = apply_landlock(root)
    load_seccomp(programs[processes])
    state["seccomp"] = "on (allow-list, default EPERM)"
    return Isolation(state, stubbed, root.scratch_fd, processes)


# -- the kernel's watch -----------------------------------------------------------------------


def _private_memory(proc: str) -> int:
    total = 0
    with open(f"{proc}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def namespace_memory(pid: int, scratch_fd: int | None, deadline: float | None = None) -> int | None:
    """Memory the preview with first process `pid` holds: the private memory of every process
    of its namespace, the memfd files they hold open, and what its scratch file system (the
    overlays' copies, /dev/shm) stores. None where /proc cannot tell, or once `deadline` (of
    time.monotonic) passes: the cell decides how many processes and descriptors there are to
    look at, and so how long a look takes."""
    if scratch_fd is None:  # still setting up: its root is not yet the private one
        try:
            return _private_memory(f"/proc/{pid}")
        except (OSError, ValueError):
            return None
    total = 0
    files: set[tuple[int, int]] = set()
    base = f"/proc/{pid}/root/proc"
    try:
        procs = [f"{base}/{n}" for n in os.listdir(base) if n.isdigit()]
    except OSError:
        return None
    for proc in procs:
        try:
            total += _private_memory(proc)
            fds = os.listdir(f"{proc}/fd")
        except (OSError, ValueError):
            continue  # (a process that just ended)
        for i, fd in enumerate(fds):
            if deadline is not None and i % 256 == 0 and time.monotonic() >= deadline:
                return None
            link = f"{proc}/fd/{fd}"
            try:
                # (one descriptor that cannot be read, such as a path past PATH_MAX, hides
                # none of the others)
                if os.readlink(link).startswith("/memfd:"):
                    st = os.stat(link)
                    if (st.st_dev, st.st_ino) not in files:
                        files.add((st.st_dev, st.st_ino))
                        total += st.st_blocks * 512
            except (OSError, ValueError):
                continue
    if scratch_fd is not None:
        try:
            vfs = os.statvfs(f"/proc/{pid}/fd/{scratch_fd}")
            total += (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        except OSError:
            pass
    return total


def available_memory() -> int | None:
    """The machine's available memory in bytes (MemAvailable), None where it cannot be told."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def sysv_shared_memory() -> int:
    """Bytes of System V shared memory in the caller's IPC namespace (resident or swapped),
    attached or not."""
    try:
        with open("/proc/sysvipc/shm") as fh:
            return sysv_total(fh.read())
    except OSError:
        return 0


def sysv_total(table: str) -> int:
    """The bytes (resident or swapped) of the segments of a /proc/sysvipc/shm table."""
    total = 0
    try:
        lines = table.splitlines()
        names = lines[0].split()
        rss, swap = names.index("rss"), names.index("swap")
        for line in lines[1:]:
            f = line.split()
            total += int(f[rss]) + int(f[swap])
    except (ValueError, IndexError):
        pass
    return total


# -- naming what a cell tried -----------------------------------------------------------------

_NETWORK_EVENTS = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")
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


def describe_event(event: str, args: tuple[Any, ...], processes: bool = True) -> str | None:
    """What a Python audit event would do outside the preview, in words; None if it stays
    inside (file writes land in the private overlay; processes run in its namespaces)."""
    try:
        if event in _NETWORK_EVENTS:
            address = args[1] if len(args) > 1 else None
            if isinstance(address, (str, bytes)) and event == "socket.bind":
                return None  # a unix socket in the private overlay
            if event == "socket.bind":
                return f"listen on the network ({address!r})"
            return f"open a network connection ({address!r})"
        if event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex"):
            host = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes)) else args[0]
            if host not in (None, "", "localhost") and not _is_address(host):
                return f"look up {host!r} on the network"
        if event == "os.kill" and args and args[0] not in (0, -1, os.getpid()):
            pid = args[0]
            if not (isinstance(pid, int) and pid > 0 and os.path.exists(f"/proc/{pid}")):
                return f"send a signal to process {pid}"
        if not processes and event in _PROCESS_EVENTS:
            if event == "subprocess.Popen" and len(args) > 1:
                what = args[1]
            else:
                what = args[0] if args else None
            if isinstance(what, (list, tuple)):
                what = " ".join(os.fsdecode(a) for a in what)
            return f"start a process ({what})" if what not in (None, "") else "start a process"
    except Exception:
        return f"do {event}"
    return None


def _is_address(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return True
    except (OSError, ValueError):
        return False


def install_audit_hook(stopped: list[str], processes: bool) -> None:
    """Name each reach outside in `stopped`, and stop the cell there."""

    def hook(event: str, args: tuple[Any, ...]) -> None:
        what = describe_event(event, args, processes)
        if what is not None:
            stopped.append(what)
            raise PreviewStopped(f"preview stopped: the cell would {what}")

    sys.addaudithook(hook)


_IO_METHODS = (
    "read",
    "read1",
    "readinto",
    "readinto1",
    "readline",
    "readlines",
    "readall",
    "write",
    "writelines",
    "flush",
    "truncate",
    "seek",
    "tell",
)
_SOCKET_METHODS = (
    "recv",
    "recv_into",
    "recvfrom",
    "recvfrom_into",
    "recvmsg",
    "send",
    "sendall",
    "sendto",
    "sendmsg",
    "sendfile",
    "setblocking",
    "settimeout",
    "shutdown",
    "accept",
    "connect",
    "connect_ex",
    "makefile",
    "setsockopt",
)


def _stopper(what: str, stopped: list[str]) -> Any:
    def stop(*args: Any, **kwargs: Any) -> Any:
        stopped.append(what)
        raise PreviewStopped(f"preview stopped: the cell would {what}")

    return stop


class _StubSocket(socket.socket):
    """A socket the kernel holds: every use stops the preview (see `stub_handles`)."""

    __slots__ = ()
    #: what each stubbed descriptor stood for, and where to name what the cell tried
    stubbed: dict[int, str] = {}
    stopped: list[str] = []


def _socket_stopper(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
    try:
        what = _StubSocket.stubbed.get(self.fileno(), "a socket")
    except OSError:
        what = "a socket"
    _StubSocket.stopped.append(f"use {what}, which the kernel holds open")
    raise PreviewStopped(f"preview stopped: the cell would use {what}, which the kernel holds open")


for _name in _SOCKET_METHODS:
    setattr(_StubSocket, _name, _socket_stopper)


def _namespace_handles(namespace: dict[str, Any]) -> Iterator[socket.socket | io.IOBase]:
    """The sockets and files among the namespace's values, the members of its small containers
    and the attributes of objects of the person's own classes: few objects touched (each touch
    copies a page of the kernel's memory into the child)."""
    seen: set[int] = set()

    def handle(obj: Any) -> bool:
        if not isinstance(obj, (socket.socket, io.IOBase)) or id(obj) in seen:
            return False
        seen.add(id(obj))
        return True

    for value in list(namespace.values()):
        if handle(value):
            yield value
        if isinstance(value, dict) and len(value) <= 1000:
            members: Any = value.values()
        elif isinstance(value, (list, tuple, set)) and len(value) <= 1000:
            members = value
        elif getattr(type(value), "__module__", None) == "__main__":
            members = getattr(value, "__dict__", {}).values()
        else:
            continue
        for member in list(members):
            if handle(member):
                yield member


_BUFFERED = (io.BufferedWriter, io.BufferedRandom, io.BufferedReader)


def _file_descriptor(obj: Any) -> int | None:
    """The descriptor of a plain file object (exact built-in types only: runs no code of the
    person's), or None."""
    kind = type(obj)
    if kind is io.TextIOWrapper:
        obj = obj.buffer
        kind = type(obj)
    if kind in _BUFFERED:
        obj = obj.raw
        kind = type(obj)
    if kind is io.FileIO and not obj.closed:
        return int(io.FileIO.fileno(obj))
    return None


def namespace_files(namespace: dict[str, Any]) -> set[int]:
    """The descriptors of the person's open files: plain file objects among the namespace's
    values and the members of its plain lists, tuples and dicts. Those open for writing get a
    private copy in the preview (see `inventory_descriptors`). Runs before the preview is
    isolated, so it looks at exact built-in types only (an `isinstance`, a `len` or an attribute
    could run the person's code)."""
    if not issubclass(type(namespace), dict):
        return set()
    fds = set()
    for value in list(dict.values(namespace)):
        kind = type(value)
        if kind is dict and len(value) <= 1000:
            members: list[Any] = list(dict.values(value))
        elif (kind is list or kind is tuple) and len(value) <= 1000:
            members = list(value)
        else:
            members = [value]
        for member in members:
            try:
                fd = _file_descriptor(member)
            except (ValueError, OSError):
                fd = None
            if fd is not None:
                fds.add(fd)
    return fds


def stub_handles(namespace: dict[str, Any], stubbed: dict[int, str], stopped: list[str]) -> int:
    """Make the person's open handles on stubbed descriptors (sockets, pipes, files open for
    writing that could not be copied) stop the preview with what they are when used, instead of
    failing with EBADF. Looks where `_namespace_handles` looks; returns how many handles it
    found. (A handle it does not find still cannot reach the descriptor.)"""
    if not stubbed:
        return 0
    _StubSocket.stubbed = stubbed
    _StubSocket.stopped = stopped
    found = 0
    for obj in _namespace_handles(namespace):
        try:
            fd = obj.fileno()
        except Exception:
            continue
        if fd not in stubbed:
            continue
        found += 1
        if isinstance(obj, socket.socket):
            try:
                obj.__class__ = _StubSocket
            except TypeError:
                pass
            continue
        what = f"use {stubbed[fd]}, which the kernel holds open"
        for name in _IO_METHODS:
            try:
                setattr(obj, name, _stopper(what, stopped))
            except (AttributeError, TypeError):
                pass
    return found
