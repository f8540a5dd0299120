"""Hostile cells against the preview, written as an attacker would: each runs in a preview of a
real kernel holding open files, sockets, pipes and shared memory, and each is checked by the
state of the world before and after it — files (content, mode, owner, times, xattrs, inode
flags), the kernel process (alive, signals, limits, priority, affinity, scheduling), its file
offsets and unread socket data, the test's own servers, IPC objects, network configuration,
host name, clock, keys, stray processes, and every message on the kernel's iopub channel (what a
browser would receive). The target is no escape at all.

The cells run in one kernel (about a second each); a cell that escaped fails its own test and
usually the ones after it too.
"""

# ruff: noqa: E501 (the hostile cells below are code, one line each)

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import mmap
import os
import signal
import socket
import subprocess
import time
import uuid
from array import array
from pathlib import Path
from typing import Any

import psutil
import pytest

from .preview_kernel import kernel_for_path, namespaces, text_of

MARK = f"themisto-hostile-{uuid.uuid4().hex[:8]}"
FS_IOC_GETFLAGS = 0x80086601

SETUP = r"""
import ctypes, errno, os, socket, struct, signal, mmap, sys, time
import numpy as np
from multiprocessing import shared_memory
import pyseccomp as _sc
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
_NEW = {"setxattrat": 463, "fchmodat2": 452}
def nr(name):
    n = _sc.resolve_syscall(_sc.system_arch(), name)
    return n if n >= 0 else _NEW[name]
def sc(name, *args):
    r = libc.syscall(ctypes.c_long(nr(name)), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return r if r != -1 else -ctypes.get_errno()
def report(label, r):
    print(label, r if r >= 0 else errno.errorcode.get(-r, r))
canary = "alive"
logf = open("@WORK@/append.log", "a")
logf.write("kernel line\n"); logf.flush()
rf = open("@WORK@/lines.txt")
first = rf.readline()
rwf = open("@WORK@/rw.bin", "r+b")
rwf.seek(100)
import io
_kernel_pid = os.getpid()
def _sprung():
    # (who sprang it, and from where: a fork of the kernel is the preview or a snapshot child)
    import traceback
    where = "".join(traceback.format_stack(limit=8)[:-1]).replace("\n", " | ")
    open("@WORK@/trap.log", "a").write(f"ESCAPED pid {os.getpid()}: {where}\n")
class _Trap(io.TextIOWrapper):
    # (a handle whose methods write a file in a preview: the preview looks for the files to
    # copy before it is isolated, and must run none of them then)
    def fileno(self):
        if os.getpid() != _kernel_pid:
            _sprung()
        return 1
    @property
    def __class__(self):
        if os.getpid() != _kernel_pid:
            _sprung()
        return io.FileIO
trap = _Trap(io.BytesIO()); traps = [trap]; trapd = {"t": trap}
import fcntl
fcntl.flock(rwf.fileno(), fcntl.LOCK_SH)
mm = np.memmap("@WORK@/mm.bin", dtype="uint8", mode="r+", shape=(4096,))
am = mmap.mmap(-1, 4096)
am[:8] = b"ORIGINAL"
shm = shared_memory.SharedMemory(create=True, size=4096, name="@MARK@-shm")
shm.buf[:8] = b"ORIGINAL"
sock = socket.create_connection(("127.0.0.1", @TCP@))
pr, pw = os.pipe()
os.write(pw, b"PIPEDATA")
"""


class World:
    """The kernel under attack and everything around it the test can observe from outside."""

    def __init__(self, root: Path, path: str) -> None:
        self.root = root
        self.work = root / "work"
        self.work.mkdir()
        (self.work / "data.csv").write_text("a,b\n1,2\n")
        (self.work / "lines.txt").write_text("".join(f"line {i}\n" for i in range(2000)))
        (self.work / "rw.bin").write_bytes(b"R" * 4096)
        (self.work / "mm.bin").write_bytes(b"\0" * 4096)
        (self.work / "append.log").write_text("")
        (self.work / "dir").mkdir()
        (self.work / "dir" / "inner.txt").write_text("inner")
        (self.work / "exe.sh").write_text("#!/bin/sh\necho hi\n")
        os.chmod(self.work / "exe.sh", 0o755)
        os.setxattr(self.work / "data.csv", "user.tag", b"original")
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.tcp.setblocking(False)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)
        self.unix_path = str(self.work / "host.sock")
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        self.unix.listen(4)
        self.unix.setblocking(False)
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind(f"\0{MARK}")
        self.abstract.listen(4)
        self.abstract.setblocking(False)
        self.kernel = kernel_for_path(path, root / "store.sqlite", self.work)
        self.tokens = {
            "@WORK@": str(self.work),
            "@MARK@": MARK,
            "@TCP@": str(self.tcp.getsockname()[1]),
            "@UDP@": str(self.udp.getsockname()[1]),
            "@UNIX@": self.unix_path,
            "@KPID@": str(self.kernel.pid),
            "@TESTPID@": str(os.getpid()),
            "@SHELL@": str(self.kernel.km.shell_port),
            "@KEY@": self.kernel.km.session.key.decode(),
        }
        self.kernel.run(self.fill(SETUP))
        deadline = time.monotonic() + 10
        while True:
            try:
                self.peer, _ = self.tcp.accept()
                break
            except BlockingIOError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        self.peer.sendall(b"PENDING-DATA")  # unread by the kernel: a preview must not take it
        self.peer.setblocking(False)
        self.rf_fd = int(self.kernel.value("rf.fileno()"))
        #: the kernel's files open for writing: the preview gets private copies of them
        self.written = {
            name: int(self.kernel.value(f"{name}.fileno()")) for name in ("logf", "rwf")
        }
        self.sock_port = int(self.kernel.value("sock.getsockname()[1]"))
        self.clock = time.time() - time.monotonic()
        # The recorder's snapshot of the setup cell (taken in a child of the kernel, which runs
        # the trap's `__class__` as `isinstance` does) is over before anything is observed:
        # settle() takes a snapshot still due and waits for the writer, then for the child.
        recorder = "__import__('jupyter_themisto.kernel').kernel.get_recorder()"
        self.kernel.value(f"{recorder}.settle(60)")
        running = f"{recorder}.snapshots.running()"
        deadline = time.monotonic() + 120
        while self.kernel.value(running) != "0":
            assert time.monotonic() < deadline, "the setup cell's snapshot never finished"
            time.sleep(0.1)
        self.children = [c.pid for c in psutil.Process(self.kernel.pid).children(recursive=True)]
        self.kernel.iopub.clear()

    def fill(self, source: str) -> str:
        for token, value in self.tokens.items():
            source = source.replace(token, value)
        return source

    def close(self) -> None:
        self.kernel.close()
        for s in (self.tcp, self.udp, self.unix, self.abstract, self.peer):
            s.close()


def _file_state(path: Path) -> tuple[Any, ...]:
    st = path.lstat()
    state: tuple[Any, ...] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns)
    if path.is_file() and not path.is_symlink():
        state += (hashlib.sha256(path.read_bytes()).hexdigest(),)
        state += (sorted((n, os.getxattr(path, n)) for n in os.listxattr(path)),)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                flags = array("l", [0])
                fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
                state += (flags[0],)
            finally:
                os.close(fd)
        except OSError as e:
            state += (e.errno,)
    return state


#: the kernel's flag of a task that is exiting (include/linux/sched.h)
PF_EXITING = 0x4


def _exiting(pid: int) -> bool:
    """Whether process `pid` is gone, a zombie or on its way out: every thread of it exiting,
    a zombie, or with SIGKILL pending. A preview's process killed as the reply came in runs
    no more user code, but its exit (the teardown of its copy of the kernel's memory) can take
    a while on a loaded machine, and the kernel reaps it in the background. Each thread is
    read: a main thread that ended while the others run looks like a zombie from outside."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # (that thread is gone)
        state, *rest = stat.rpartition(")")[2].split()
        pending = [
            int(line.split()[1], 16)
            for line in status.splitlines()
            if line.startswith(("SigPnd", "ShdPnd"))
        ]
        killed = any(p & (1 << (signal.SIGKILL - 1)) for p in pending)
        if not (state in ("Z", "X", "x") or int(rest[5]) & PF_EXITING or killed):
            return False
    return True


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout


def _queue(port: int) -> str | None:
    """The kernel's TCP socket's unread bytes (rx_queue in /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port:
            return f[4]
    return None


def observe(w: World) -> dict[str, Any]:
    """The state of everything a preview must not change."""
    k = w.kernel
    proc = psutil.Process(k.pid)
    status = {
        line.split(":")[0]: line.split(":")[1].strip()
        for line in Path(f"/proc/{k.pid}/status").read_text().splitlines()
        if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt", "Cpus_allowed_list"))
        or line.startswith(("NoNewPrivs", "Seccomp"))
    }
    rlimits = {
        name: proc.rlimit(getattr(psutil, name))
        for name in dir(psutil)
        if name.startswith("RLIMIT_")
    }
    pos = Path(f"/proc/{k.pid}/fdinfo/{w.rf_fd}").read_text().split()[1]
    # The offsets and flags of the kernel's files open for writing, and the locks on them.
    written = {
        name: Path(f"/proc/{k.pid}/fdinfo/{fd}").read_text().split("\n")[:2]
        for name, fd in w.written.items()
    }
    inodes = {f":{(w.work / n).stat().st_ino} " for n in ("append.log", "rw.bin")}
    locks = [
        line.split(":", 1)[1]
        for line in Path("/proc/locks").read_text().splitlines()
        if any(i in line for i in inodes)
    ]
    files = {
        str(p.relative_to(w.work)): _file_state(p)
        for p in sorted(w.work.rglob("*"))
        if p.name != "host.sock"
    }
    system = {}
    for p in (
        "/etc/hosts",
        "/etc/passwd",
        "/etc/hostname",
        "/dev/null",
        "/dev/zero",
        "/proc/sys/kernel/printk",
    ):
        system[p] = _file_state(Path(p)) if not p.startswith("/proc") else Path(p).read_text()
    stray = []
    for base in ("/tmp", "/", "/root", "/dev/shm", "/etc", "/etc/cron.d", str(w.root)):
        try:
            stray += [
                f"{base}/{n}" for n in os.listdir(base) if MARK in n and not n.endswith("-shm")
            ]
        except OSError:
            pass
    stray += [n for n in os.listdir("/dev/shm") if MARK in n and n != f"{MARK}-shm"]
    for s in (w.tcp, w.unix, w.abstract):
        try:
            s.accept()[0].close()
            stray.append(f"a connection to {s.getsockname()!r}")
        except BlockingIOError:
            pass
    try:
        stray.append(f"a datagram {w.udp.recv(100)!r}")
    except BlockingIOError:
        pass
    try:
        stray.append(f"the peer got {w.peer.recv(100)!r}")
    except BlockingIOError:
        pass
    processes = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if MARK in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid()
    ]
    children = [c.pid for c in proc.children(recursive=True) if not _exiting(c.pid)]
    return {
        "kernel": (
            proc.is_running(),
            proc.status() in (psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING),
            proc.nice(),
            proc.cpu_affinity(),
            status,
        ),
        "rlimits": rlimits,
        "scheduler": os.sched_getscheduler(k.pid),
        "offset": pos,
        "written": written,
        "locks": locks,
        "socket queue": _queue(w.sock_port),
        "files": files,
        "system": system,
        "stray": stray,
        "processes": processes,
        "children": children,
        "ipc": [Path(f"/proc/sysvipc/{n}").read_text() for n in ("shm", "sem", "msg")],
        "keys": [line for line in Path("/proc/keys").read_text().splitlines() if MARK in line],
        "network": [
            _run("ip", "-o", "addr", "show"),
            _run("ip", "-o", "link", "show"),
            _run("ip", "route", "show", "table", "all"),
            _run("ip", "-6", "route", "show", "table", "all"),
            Path("/proc/sys/net/ipv4/ip_forward").read_text(),
        ],
        "hostname": (socket.gethostname(), os.uname().nodename),
        # (a thread of the kernel that enters the preview's namespaces to fork it must leave)
        "kernel namespaces": sorted(namespaces(k.pid)),
        "clock": round(time.time() - time.monotonic() - w.clock),
    }


@pytest.fixture(scope="module", params=["direct", "monitor"])
def world(tmp_path_factory, request):
    """The suite runs twice: against a root kernel, which forks its previews straight into
    their namespaces, and against one without CAP_SYS_ADMIN, whose previews go through a
    monitor that enters a user namespace first."""
    w = World(tmp_path_factory.mktemp(f"hostile-{request.param}"), request.param)
    yield w
    # The kernel's own handles still hold what they held: the preview took nothing.
    k = w.kernel
    assert k.value("sock.recv(100)") == "b'PENDING-DATA'"
    assert k.value("os.read(pr, 100)") == "b'PIPEDATA'"
    assert k.value("bytes(am[:8]), bytes(shm.buf[:8]), int(mm.sum())") == (
        "(b'ORIGINAL', b'ORIGINAL', 0)"
    )
    k.run("shm.close(); shm.unlink()")
    w.close()


# (name, cell): @TOKENS@ are filled in by World.fill. Every cell tries something that would
# change the world outside the preview; most print how Linux answered.
CELLS: list[tuple[str, str]] = [
    # -- writes through inherited descriptors ------------------------------------------------
    ("dup2 a kernel file onto stdout", "os.dup2(logf.fileno(), 1)\nos.write(1, b'ESCAPED\\n')"),
    (
        "dup3 via syscall",
        "report('dup3', sc('dup3', logf.fileno(), 1, 0))\nreport('w', libc.write(1, b'ESCAPED\\n', 8))",
    ),
    (
        "F_DUPFD a kernel file",
        "import fcntl\nfd = fcntl.fcntl(logf.fileno(), fcntl.F_DUPFD, 100)\nos.write(fd, b'ESCAPED\\n')",
    ),
    (
        "write the open log",
        "logf.write('ESCAPED\\n'); logf.flush()\nprint(open('@WORK@/append.log').read(), end='')",
    ),
    (
        "libc write to every descriptor",
        "for fd in range(0, 300):\n    libc.write(fd, b'ESCAPED\\n', 8)\nprint('done')",
    ),
    (
        "os.write to every descriptor",
        "for fd in range(0, 300):\n    try: os.write(fd, b'ESCAPED\\n')\n    except OSError: pass\nprint('done')",
    ),
    (
        "dup2 every descriptor onto 1 and write",
        "for fd in range(3, 300):\n    try:\n        os.dup2(fd, 1); os.write(1, b'ESCAPED\\n')\n    except OSError: pass\nprint('done')",
    ),
    (
        "pwritev to every descriptor",
        "for fd in range(3, 300):\n    try: os.pwritev(fd, [b'ESCAPED'], 0)\n    except OSError: pass\nprint('done')",
    ),
    (
        "sendfile into every descriptor",
        "src = os.open('@WORK@/data.csv', os.O_RDONLY)\nfor fd in range(3, 300):\n    try: os.sendfile(fd, src, 0, 4)\n    except OSError: pass\nprint('done')",
    ),
    (
        "splice into every descriptor",
        "r, w = os.pipe(); os.write(w, b'ESCAPED')\nfor fd in range(3, 300):\n    try: os.splice(r, fd, 7)\n    except OSError: pass\nprint('done')",
    ),
    (
        "fdopen every descriptor for writing",
        "for fd in range(3, 300):\n    try:\n        f = os.fdopen(fd, 'w', closefd=False); f.write('ESCAPED'); f.flush()\n    except Exception: pass\nprint('done')",
    ),
    (
        "reopen a kernel descriptor through /proc for writing",
        "for fd in range(3, 300):\n    try: open(f'/proc/self/fd/{fd}', 'a').write('ESCAPED')\n    except Exception: pass\nprint('done')",
    ),
    (
        "write through the read-write handle",
        "rwf.seek(0); rwf.write(b'ESCAPED'); rwf.flush()\nprint(open('@WORK@/rw.bin', 'rb').read(9))",
    ),
    ("truncate the read-write handle", "os.ftruncate(rwf.fileno(), 0)"),
    ("fallocate punch hole", "report('fallocate', sc('fallocate', rwf.fileno(), 3, 0, 4096))"),
    (
        "copy_file_range into the log",
        "src = os.open('@WORK@/data.csv', os.O_RDONLY)\nos.copy_file_range(src, logf.fileno(), 4)",
    ),
    (
        "MAP_SHARED of a kernel handle",
        "m = mmap.mmap(rwf.fileno(), 4096, mmap.MAP_SHARED, mmap.PROT_WRITE | mmap.PROT_READ)\nm[:7] = b'ESCAPED'; m.flush()",
    ),
    (
        "MAP_SHARED writable of a read handle",
        "m = mmap.mmap(rf.fileno(), 100, mmap.MAP_SHARED, mmap.PROT_WRITE)",
    ),
    ("numpy memmap r+ made by the kernel", "mm[:] = 7\nmm.flush()\nprint(int(mm.sum()))"),
    ("anonymous shared mapping of the kernel", "am[:8] = b'ESCAPED!'\nprint(bytes(am[:8]))"),
    (
        "multiprocessing shared memory of the kernel",
        "shm.buf[:8] = b'ESCAPED!'\nprint(bytes(shm.buf[:8]))",
    ),
    (
        "mprotect the shared mappings writable",
        "import re\nfor line in open('/proc/self/maps'):\n    if line.split()[1][3] == 's':\n        a, b = (int(x, 16) for x in line.split()[0].split('-'))\n        libc.mprotect(ctypes.c_void_p(a), b - a, 3)\n        try: ctypes.memset(a, 69, 8)\n        except Exception: pass\nprint('done')",
    ),
    (
        "io_submit write to the log",
        "ctx = ctypes.c_ulong(0)\nreport('io_setup', sc('io_setup', 8, ctypes.byref(ctx)))\nbuf = ctypes.create_string_buffer(b'ESCAPED')\ncb = (ctypes.c_uint64 * 8)(0, 0, (1 << 32) | logf.fileno(), ctypes.addressof(buf), 7, 0, 0, 0)\ncbs = (ctypes.c_void_p * 1)(ctypes.addressof(cb))\nreport('io_submit', sc('io_submit', ctx.value, 1, cbs))",
    ),
    (
        "io_uring_setup",
        "params = ctypes.create_string_buffer(120)\nreport('io_uring_setup', sc('io_uring_setup', 8, params))",
    ),
    # -- metadata, attributes, flags ---------------------------------------------------------
    (
        "fchmodat2 the data file",
        "report('fchmodat2', sc('fchmodat2', -100, b'@WORK@/data.csv', 0o777, 0))",
    ),
    (
        "setxattrat the data file",
        "report('setxattrat', sc('setxattrat', -100, b'@WORK@/data.csv', 0, b'user.tag', ctypes.byref((ctypes.c_uint64 * 3)(ctypes.addressof(ctypes.create_string_buffer(b'evil')), 4, 0)), 24))",
    ),
    (
        "chmod, chown, utime, setxattr by path",
        "p = '@WORK@/data.csv'\nos.chmod(p, 0o777); os.chown(p, 1234, 1234); os.utime(p, (0, 0)); os.setxattr(p, 'user.tag', b'evil')\nprint(oct(os.stat(p).st_mode), os.getxattr(p, 'user.tag'))",
    ),
    (
        "fchmod and fchown the read handle",
        "for f in (os.fchmod, ):\n    try: f(rf.fileno(), 0o777)\n    except OSError as e: print(e.errno)\ntry: os.fchown(rf.fileno(), 1234, 1234)\nexcept OSError as e: print(e.errno)",
    ),
    (
        "FS_IOC_SETFLAGS on the data file",
        "import fcntl, array\nfd = os.open('@WORK@/data.csv', os.O_RDONLY)\nfcntl.ioctl(fd, 0x40086602, array.array('l', [0x00000010 | 0x00000040]))\nprint('flags set in the overlay')",
    ),
    (
        "FS_IOC_SETFLAGS on the kernel's read handle",
        "import fcntl, array\nfcntl.ioctl(rf.fileno(), 0x40086602, array.array('l', [0x00000040]))",
    ),
    ("lsattr-chattr the data file", "!chattr +d @WORK@/data.csv; lsattr @WORK@/data.csv"),
    (
        "truncate, remove, rename real files",
        "os.truncate('@WORK@/lines.txt', 0)\nos.remove('@WORK@/data.csv')\nos.rename('@WORK@/dir', '@WORK@/moved')\nimport shutil; shutil.rmtree('@WORK@/moved')\nprint(sorted(os.listdir('@WORK@')))",
    ),
    (
        "links and special files in the work dir",
        "os.symlink('/etc/passwd', '@WORK@/@MARK@-link')\nos.link('@WORK@/data.csv', '@WORK@/@MARK@-hard')\nos.mkfifo('@WORK@/@MARK@-fifo')\nprint(sorted(n for n in os.listdir('@WORK@') if '@MARK@' in n))",
    ),
    (
        "write system files as root",
        "open('/etc/hosts', 'a').write('6.6.6.6 evil\\n')\nopen('/etc/passwd', 'a').write('evil::0:0::/:/bin/sh\\n')\nopen('/etc/ld.so.preload', 'w').write('/tmp/evil.so')\nopen('/etc/cron.d/@MARK@', 'w').write('* * * * * root id\\n')\nprint(open('/etc/hosts').read()[-13:])",
    ),
    (
        "write home and startup files",
        "os.makedirs(os.path.expanduser('~/.ipython/profile_default/startup'), exist_ok=True)\nopen(os.path.expanduser('~/.ipython/profile_default/startup/@MARK@.py'), 'w').write('print(1)')\nopen(os.path.expanduser('~/.bashrc'), 'a').write('echo evil\\n')\nopen('/root/@MARK@', 'w').write('x')\nprint('written')",
    ),
    (
        "write /tmp, /dev/shm and / ",
        "for d in ('/tmp', '/dev/shm', '/', '/var/tmp'):\n    try: open(f'{d}/@MARK@', 'w').write('x'); print(d, 'ok')\n    except OSError as e: print(d, e.strerror)",
    ),
    (
        "write the kernel's connection file",
        "from jupyter_client import find_connection_file\nimport glob\nfor p in glob.glob('/root/.local/share/jupyter/runtime/*.json') + glob.glob('/tmp/*.json'):\n    try: open(p, 'a').write('ESCAPED')\n    except OSError: pass\nprint('done')",
    ),
    (
        "write /proc/sys",
        "for p in ('kernel/hostname', 'vm/drop_caches', 'net/ipv4/ip_forward', 'kernel/printk'):\n    try: open('/proc/sys/' + p, 'w').write('1'); print(p, 'written')\n    except OSError as e: print(p, e.strerror)",
    ),
    (
        "write /proc/sysrq-trigger and /sys",
        "for p in ('/proc/sysrq-trigger', '/sys/kernel/mm/transparent_hugepage/enabled', '/sys/class/net/lo/mtu'):\n    try: open(p, 'w').write('s'); print(p, 'written')\n    except OSError as e: print(p, e.strerror)",
    ),
    (
        "chmod /dev/null and write /dev nodes",
        "for f in (lambda: os.chmod('/dev/null', 0o600), lambda: os.chown('/dev/null', 1, 1), lambda: open('/dev/@MARK@', 'w')):\n    try: f(); print('ok')\n    except OSError as e: print(e.strerror)",
    ),
    (
        "mknod a block device of the disk",
        "st = os.stat('/') \nprint(sc('mknodat', -100, b'@WORK@/@MARK@-disk', 0o60600, st.st_dev))\ntry: os.open('@WORK@/@MARK@-disk', os.O_RDWR)\nexcept OSError as e: print(e.strerror)",
    ),
    (
        "open the disk through /sys or /dev",
        "import glob\nfor p in glob.glob('/dev/[vsh]d*') + glob.glob('/dev/nvme*') + glob.glob('/dev/mem') + glob.glob('/dev/kmsg'):\n    try: open(p, 'wb').write(b'x'); print(p, 'written')\n    except OSError as e: print(p, e.strerror)\nprint('done')",
    ),
    # -- the kernel process as a target ------------------------------------------------------
    ("kill the kernel", "os.kill(@KPID@, signal.SIGKILL)"),
    (
        "raw kill of the kernel",
        "report('kill', sc('kill', @KPID@, 9))\nreport('kill stop', sc('kill', @KPID@, 19))",
    ),
    ("kill the test runner", "report('kill', sc('kill', @TESTPID@, 9))"),
    (
        "kill the process group and everyone",
        "report('kill0', sc('kill', 0, 10))\nreport('kill-1', sc('kill', -1, 10))\nreport('killpg', sc('kill', -os.getpgid(0), 10))",
    ),
    (
        "pidfd_send_signal to the kernel",
        "fd = sc('pidfd_open', @KPID@, 0)\nreport('pidfd_open', fd)\nreport('pidfd_send_signal', sc('pidfd_send_signal', max(fd, 0), 9, None, 0))",
    ),
    (
        "sigqueue to the kernel",
        "info = ctypes.create_string_buffer(128)\nreport('rt_sigqueueinfo', sc('rt_sigqueueinfo', @KPID@, 10, info))",
    ),
    (
        "tgkill every kernel thread",
        "for t in [@KPID@] + list(range(@KPID@ + 1, @KPID@ + 40)):\n    sc('tgkill', @KPID@, t, 19)\nprint('done')",
    ),
    (
        "prlimit the kernel",
        "new = (ctypes.c_uint64 * 2)(5, 5)\nreport('prlimit', sc('prlimit64', @KPID@, 7, new, None))",
    ),
    (
        "setpriority of the kernel, its group, the user",
        "report('process', sc('setpriority', 0, @KPID@, 19))\nreport('pgrp', sc('setpriority', 1, 0, 19))\nreport('user', sc('setpriority', 2, 0, 19))",
    ),
    (
        "sched_setaffinity of the kernel",
        "mask = ctypes.c_ulong(1)\nreport('affinity', sc('sched_setaffinity', @KPID@, 8, ctypes.byref(mask)))",
    ),
    (
        "sched_setscheduler of the kernel",
        "param = ctypes.c_int(0)\nreport('scheduler', sc('sched_setscheduler', @KPID@, 5, ctypes.byref(param)))",
    ),
    (
        "sched_setattr of the kernel",
        "attr = (ctypes.c_uint32 * 14)(56, 5)\nreport('setattr', sc('sched_setattr', @KPID@, attr, 0))",
    ),
    ("ioprio_set of the kernel", "report('ioprio', sc('ioprio_set', 1, @KPID@, (3 << 13)))"),
    (
        "ptrace the kernel",
        "report('attach', sc('ptrace', 16, @KPID@, 0, 0))\nreport('seize', sc('ptrace', 0x4206, @KPID@, 0, 0))",
    ),
    (
        "process_vm_writev into the kernel",
        "buf = ctypes.create_string_buffer(8)\nlocal = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)\nremote = (ctypes.c_void_p * 2)(0x400000, 8)\nreport('vm_writev', sc('process_vm_writev', @KPID@, local, 1, remote, 1, 0))",
    ),
    (
        "write the kernel's memory through /proc",
        "for p in ('/proc/@KPID@/mem', f'/proc/{os.getppid()}/mem', '/proc/1/mem'):\n    try:\n        with open(p, 'r+b') as f: f.seek(0x400000); f.write(b'x'); print(p, 'written')\n    except OSError as e: print(p, e.strerror)",
    ),
    (
        "reopen the kernel's descriptors through /proc",
        "import glob\nfor p in glob.glob('/proc/@KPID@/fd/*'):\n    try: open(p, 'a').write('ESCAPED')\n    except OSError: pass\nprint(len(glob.glob('/proc/@KPID@/*')))",
    ),
    (
        "pidfd_getfd and kcmp on the kernel",
        "fd = sc('pidfd_open', @KPID@, 0)\nreport('getfd', sc('pidfd_getfd', max(fd, 0), 3, 0))\nreport('kcmp', sc('kcmp', os.getpid(), @KPID@, 0, 1, 1))",
    ),
    (
        "migrate and advise the kernel's pages",
        "report('migrate', sc('migrate_pages', @KPID@, 64, None, None))\nreport('move', sc('move_pages', @KPID@, 0, None, None, None, 0))\nreport('madvise', sc('process_madvise', 0, None, 0, 21, 0))",
    ),
    (
        "the preview's own limits cannot be raised",
        "import resource\ntry: resource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6))\nexcept Exception as e: print(type(e).__name__)\nprint(open('/proc/self/status').read().split('CapEff:')[1].split()[0])",
    ),
    (
        "escape the parent death signal and outlive the deadline",
        "libc.prctl(1, 0, 0, 0, 0)\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(30)",
    ),
    # -- IPC that could outlive the preview --------------------------------------------------
    (
        "System V shared memory left behind",
        "report('shmget', libc.shmget(0x7a7a7a, 4096, 0o1666))\nprint(open('/proc/sysvipc/shm').read().count('\\n'))",
    ),
    ("System V semaphores left behind", "report('semget', libc.semget(0x7a7a7b, 4, 0o1666))"),
    (
        "System V message queue left behind",
        "q = libc.msgget(0x7a7a7c, 0o1666)\nreport('msgget', q)\nmsg = struct.pack('l', 1) + b'ESCAPED'\nreport('msgsnd', libc.msgsnd(q, msg, 7, 0))",
    ),
    (
        "POSIX message queue left behind",
        "rt = ctypes.CDLL('librt.so.1', use_errno=True)\nq = rt.mq_open(b'/@MARK@', os.O_CREAT | os.O_RDWR, 0o666, None)\nprint('mq', q >= 0)\nprint(rt.mq_send(q, b'ESCAPED', 7, 0))",
    ),
    (
        "POSIX shared memory and semaphore left behind",
        "from multiprocessing import shared_memory\ns = shared_memory.SharedMemory(create=True, size=4096, name='@MARK@-new')\nimport _multiprocessing\ns2 = _multiprocessing.SemLock(1, 1, 1, '/@MARK@-sem', False)\nprint(sorted(n for n in os.listdir('/dev/shm') if '@MARK@' in n))",
    ),
    (
        "a unix socket file left behind",
        "u = socket.socket(socket.AF_UNIX)\nu.bind('@WORK@/@MARK@.sock'); u.listen(1)\nprint(os.path.exists('@WORK@/@MARK@.sock'))",
    ),
    (
        "an abstract unix socket listening",
        "u = socket.socket(socket.AF_UNIX)\nu.bind('\\0@MARK@-listen'); u.listen(1)\nprint('listening')",
    ),
    (
        "use up the user's inotify instances (shared with every process of the user)",
        "made = 0\nwhile libc.inotify_init1(0) >= 0 and made < 1000:\n    made += 1\nprint('inotify', made, errno.errorcode[ctypes.get_errno()])",
    ),
    (
        "a lease on a file the kernel reads",
        "import fcntl\nfd = os.open(rf.name, os.O_RDONLY)\ntry:\n    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)\n    print('leased')\nexcept OSError as e:\n    print('refused', errno.errorcode[e.errno])",
    ),
    # -- the reply channel --------------------------------------------------------------------
    (
        "a forged reply of the wrong shapes written to the reply pipe",
        "import json, stat\nforged = {'outputs': 5, 'stopped': ['x\\n[I ServerApp] forged line'], 'status': 'ok', 'sandbox': {'a': 1}, 'times': {'ran': 'x'}, 'cpu_bound': 'x'}\nfor fd in range(3, 256):\n    try:\n        if stat.S_ISFIFO(os.fstat(fd).st_mode):\n            os.write(fd, b'\\n' + json.dumps(forged).encode() + b'\\n\\x04')\n    except OSError:\n        pass\nos._exit(0)",
    ),
    (
        "innocent: a NaN in a display's metadata",
        "from IPython.display import display\ndisplay({'text/plain': 'shown'}, metadata={'m': float('nan')}, raw=True)",
    ),
    # -- bounds: memory, reply, time, processes ----------------------------------------------
    (
        "memfd beyond the memory bound",
        "fd = os.memfd_create('x')\nos.ftruncate(fd, 1 << 31)\nm = mmap.mmap(fd, 1 << 31)\nfor i in range(0, 1 << 31, 4096):\n    m[i] = 1",
    ),
    (
        "memfd written, unmapped, beyond the bound",
        "fd = os.memfd_create('x')\nfor _ in range(600):\n    os.write(fd, b'x' * (1 << 20))\ntime.sleep(5)",
    ),
    (
        "socket buffers beyond the bound",
        "pairs = []\nfor i in range(400):\n    a, b = socket.socketpair()\n    for s in (a, b):\n        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)\n        s.setblocking(False)\n    for s in (a, b):\n        try:\n            while True:\n                s.send(b'x' * 65536)\n        except BlockingIOError:\n            pass\n    pairs.append((a, b))\ntime.sleep(5)",
    ),
    (
        "memfd hidden behind a descriptor whose path cannot be read",
        "here = os.getcwd()\nos.chdir('/tmp')\nfor i in range(50):\n    os.mkdir('d' * 100)\n    os.chdir('d' * 100)\nfd = os.open('f', os.O_CREAT | os.O_RDWR)\nos.dup2(fd, 0)\nos.close(fd)\nos.chdir(here)\nm = os.memfd_create('big')\nfor _ in range(700):\n    os.write(m, b'x' * (1 << 20))\ntime.sleep(5)",
    ),
    (
        "descriptors by the thousand in many processes slow the memory look past the deadline",
        "import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\nresource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))\nfd = os.open('/dev/null', os.O_RDONLY)\ntry:\n    for _ in range(min(hard, 1 << 16) - 64):\n        os.dup(fd)\nexcept OSError:\n    pass\nfor i in range(200):\n    if os.fork() == 0:\n        time.sleep(600)\n        os._exit(0)\ntime.sleep(600)",
    ),
    (
        "shm segments beyond the bound",
        "ids = [libc.shmget(0, 64 << 20, 0o1600) for _ in range(10)]\nfor i in ids:\n    if i >= 0:\n        libc.shmat.restype = ctypes.c_void_p\n        a = libc.shmat(i, None, 0)\n        ctypes.memset(a, 1, 64 << 20)\n        libc.shmdt(ctypes.c_void_p(a))\nprint(ids)\ntime.sleep(5)",
    ),
    (
        "a huge reply written to the reply pipe",
        "import stat\nfor fd in range(3, 300):\n    try:\n        if stat.S_ISFIFO(os.fstat(fd).st_mode):\n            for _ in range(4096): os.write(fd, b'x' * (1 << 20))\n    except OSError: pass",
    ),
    ("an 8 MB printed output", "for _ in range(128):\n    print('x' * (1 << 16))"),
    ("a huge printed output", "for _ in range(1 << 14):\n    print('x' * (1 << 16))"),
    (
        "an endless C-level loop ignoring signals",
        "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n    signal.signal(s, signal.SIG_IGN)\nlibc.pause()",
    ),
    (
        "a fork bomb",
        "pids = []\nfor _ in range(2000):\n    try:\n        p = os.fork()\n    except OSError as e:\n        print('fork', e.strerror); break\n    if p == 0:\n        time.sleep(60); os._exit(0)\n    pids.append(p)\nprint(len(pids) < 600)\ntime.sleep(60)",
    ),
    (
        "a daemon that outlives the preview",
        "import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 120 # @MARK@'], start_new_session=True)\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        os.execvp('sleep', ['sleep', '120', '@MARK@'])\n    os._exit(0)\ntime.sleep(0.5)\nprint('daemonized')",
    ),
    (
        "a process holding the reply pipe open",
        "if os.fork() == 0:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    time.sleep(120)\n    os._exit(0)\nprint('parent leaves')",
    ),
    ("exit without a reply", "os._exit(3)"),
    # (the CPU bound: the preview's own SIGXCPU handler stops the cell at the soft limit)
    (
        "a SIGXCPU handler of its own at the CPU bound",
        "def h(*a):\n    open('@WORK@/@MARK@-cpu', 'w').write('ESCAPED')\n    try: os.kill(@KPID@, signal.SIGKILL)\n    except BaseException as e: print('kill', type(e).__name__)\nsignal.signal(signal.SIGXCPU, h)\nwhile True:\n    pass",
    ),
    (
        "the CPU bound's stop caught and the loop goes on",
        "try:\n    while True:\n        pass\nexcept BaseException as e:\n    print('caught', type(e).__name__)\n    open('@WORK@/@MARK@-cpu', 'w').write('ESCAPED')\nwhile True:\n    pass",
    ),
    (
        "a forged CPU-bound signal, then writes",
        "try:\n    signal.raise_signal(signal.SIGXCPU)\nexcept BaseException as e:\n    print('caught', type(e).__name__)\nos.write(logf.fileno(), b'ESCAPED')\nopen('@WORK@/data.csv', 'a').write('ESCAPED')",
    ),
    ("crash with a core dump", "import ctypes\nctypes.string_at(0)"),
    ("abort in C", "libc.abort()"),
    # -- network -----------------------------------------------------------------------------
    (
        "TCP connect to the test's server",
        "s = socket.socket()\nprint(s.connect_ex(('127.0.0.1', @TCP@)))",
    ),
    (
        "raw TCP connect through libc",
        "fd = libc.socket(2, 1, 0)\naddr = struct.pack('=H', 2) + struct.pack('>H', @TCP@) + bytes([127, 0, 0, 1]) + bytes(8)\nreport('connect', libc.connect(fd, addr, 16))",
    ),
    (
        "UDP datagram to the test's server",
        "fd = libc.socket(2, 2, 0)\naddr = struct.pack('=H', 2) + struct.pack('>H', @UDP@) + bytes([127, 0, 0, 1]) + bytes(8)\nreport('sendto', libc.sendto(fd, b'ESCAPED', 7, 0, addr, 16))",
    ),
    (
        "UDP through sendmsg",
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ntry: s.sendmsg([b'ESCAPED'], [], 0, ('127.0.0.1', @UDP@))\nexcept Exception as e: print(type(e).__name__)",
    ),
    ("the kernel's own TCP socket", "print(sock.recv(100))"),
    ("the kernel's socket made non-blocking and shut", "sock.setblocking(False)"),
    ("the kernel's socket shut down", "sock.shutdown(socket.SHUT_RDWR)"),
    (
        "the kernel's socket read through its descriptor",
        "report('recv', libc.recv(sock.fileno(), ctypes.create_string_buffer(100), 100, 0))\nreport('read', libc.read(sock.fileno(), ctypes.create_string_buffer(100), 100))",
    ),
    ("the kernel's pipe read", "print(os.read(pr, 100))"),
    (
        "the kernel's shell port with the session key",
        "import zmq\nfrom jupyter_client.session import Session\ns = Session(key=b'@KEY@', signature_scheme='hmac-sha256')\nd = zmq.Context().socket(zmq.DEALER)\nd.connect('tcp://127.0.0.1:@SHELL@')\ns.send(d, s.msg('execute_request', {'code': \"open('@WORK@/@MARK@-forged', 'w')\", 'silent': False}))\nprint(d.poll(1500))",
    ),
    (
        "forge a signed iopub stream with the kernel's session",
        "k = get_ipython().kernel\nk.session.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'FORGED @MARK@'}, parent=k.get_parent('shell'))\nk.iopub_socket.send_multipart([b'stream', b'FORGED @MARK@'])\nprint('sent')",
    ),
    (
        "publish through ipykernel's streams",
        "sys.__stdout__.write('FORGED @MARK@\\n'); sys.__stdout__.flush()\nget_ipython().kernel.iopub_thread.schedule(lambda: None)\nprint('scheduled')",
    ),
    ("unix socket of the host", "u = socket.socket(socket.AF_UNIX)\nprint(u.connect_ex('@UNIX@'))"),
    (
        "abstract unix socket of the host",
        "u = socket.socket(socket.AF_UNIX)\nprint(u.connect_ex('\\0@MARK@'))",
    ),
    (
        "raw libc connect to a unix socket",
        "addr = struct.pack('=H', 1) + b'@UNIX@'.ljust(108, b'\\0')\nfd = libc.socket(1, 1, 0)\nreport('connect', libc.connect(fd, addr, len(addr)))",
    ),
    (
        "netlink: add an address and a route",
        "!ip addr add 10.213.0.1/32 dev lo; ip link set lo up; ip route add 10.214.0.0/16 dev lo; ip -o addr",
    ),
    (
        "netlink: take the host's interfaces down",
        "import subprocess\nfor line in open('/proc/net/dev').read().splitlines()[2:]:\n    name = line.split(':')[0].strip()\n    print(name, subprocess.run(['ip', 'link', 'set', name, 'down']).returncode)",
    ),
    (
        "netlink socket in Python",
        "try:\n    n = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)\n    print('netlink', n)\nexcept OSError as e: print(e.strerror)",
    ),
    (
        "packet, vsock and other families",
        "for fam, typ in ((17, 3), (40, 1), (38, 5), (16, 3)):\n    try: socket.socket(fam, typ); print(fam, 'opened')\n    except OSError as e: print(fam, e.strerror)",
    ),
    ("forward IPv4", "!sysctl -w net.ipv4.ip_forward=1; echo 1 > /proc/sys/net/ipv4/ip_forward"),
    ("name lookup", "print(socket.gethostbyname('example.org'))"),
    # -- privileged operations ---------------------------------------------------------------
    (
        "clock_settime",
        "ts = (ctypes.c_long * 2)(int(time.time()) + 86400 * 365, 0)\nreport('clock_settime', sc('clock_settime', 0, ts))",
    ),
    (
        "settimeofday and adjtimex",
        "tv = (ctypes.c_long * 2)(0, 0)\nreport('settimeofday', sc('settimeofday', tv, None))\nbuf = ctypes.create_string_buffer(208)\nctypes.memmove(buf, struct.pack('I', 0x0001), 4)\nreport('adjtimex', sc('adjtimex', buf))",
    ),
    ("date -s", "!date -s '2001-01-01' ; hwclock -w 2>&1 | head -1"),
    (
        "sethostname",
        "report('sethostname', sc('sethostname', b'@MARK@', 8))\nreport('setdomainname', sc('setdomainname', b'@MARK@', 8))\nprint(socket.gethostname())",
    ),
    (
        "mount a tmpfs over the work dir",
        "report('mount', sc('mount', b'none', b'@WORK@', b'tmpfs', 0, None))\nreport('umount /proc', sc('umount2', b'/proc', 2))\nreport('umount /', sc('umount2', b'/', 2))",
    ),
    (
        "remount the root read-write and unmount the overlay",
        "report('remount', sc('mount', None, b'/', None, 32 | 4096, None))\nreport('umount work', sc('umount2', b'@WORK@', 2))",
    ),
    (
        "new mount API",
        "report('fsopen', sc('fsopen', b'tmpfs', 0))\nreport('open_tree', sc('open_tree', -100, b'/', 1))\nreport('mount_setattr', sc('mount_setattr', -100, b'/', 0x8000, None, 0))",
    ),
    (
        "chroot and pivot_root",
        "report('chroot', sc('chroot', b'/tmp'))\nreport('pivot_root', sc('pivot_root', b'/tmp', b'/tmp'))",
    ),
    (
        "new namespaces and setns",
        "report('unshare', sc('unshare', 0x10000000 | 0x20000))\nfd = os.open('/proc/1/ns/mnt', os.O_RDONLY)\nreport('setns', sc('setns', fd, 0))\nreport('clone', sc('clone', 0x10000000 | 17, 0, 0, 0, 0))",
    ),
    (
        "user namespace through the unshare program",
        "!unshare -Urmn sh -c 'mount -t tmpfs none /mnt && id'",
    ),
    (
        "keyctl and add_key",
        "report('add_key', sc('add_key', b'user', b'@MARK@', b'secret', 6, -4))\nreport('keyctl', sc('keyctl', 1, b'@MARK@'))",
    ),
    (
        "bpf",
        "attr = ctypes.create_string_buffer(128)\nctypes.memmove(attr, struct.pack('IIII', 2, 4, 4, 16), 16)\nreport('bpf map', sc('bpf', 0, attr, 128))",
    ),
    (
        "perf_event_open",
        "attr = ctypes.create_string_buffer(128)\nctypes.memmove(attr, struct.pack('II', 1, 128), 8)\nreport('perf', sc('perf_event_open', attr, @KPID@, -1, -1, 0))",
    ),
    ("userfaultfd", "report('userfaultfd', sc('userfaultfd', 0))"),
    (
        "kernel modules",
        "report('init_module', sc('init_module', None, 0, b''))\nreport('delete_module', sc('delete_module', b'loop', 0))\nreport('finit_module', sc('finit_module', 0, b'', 0))",
    ),
    ("process accounting", "report('acct', sc('acct', b'@WORK@/@MARK@-acct'))"),
    ("kernel log level", "report('syslog', sc('syslog', 8, None, 1))"),
    (
        "open_by_handle_at",
        "buf = ctypes.create_string_buffer(128)\nctypes.memmove(buf, struct.pack('II', 8, 1), 8)\nreport('open_by_handle_at', sc('open_by_handle_at', os.open('/', os.O_RDONLY), buf, 0))\nreport('name_to_handle_at', sc('name_to_handle_at', -100, b'/etc', buf, ctypes.byref(ctypes.c_int()), 0))",
    ),
    (
        "port I/O and quotas",
        "report('iopl', sc('iopl', 3))\nreport('ioperm', sc('ioperm', 0x80, 1, 1))\nreport('quotactl', sc('quotactl', 0x800002, b'/dev/vda', 0, None))",
    ),
    ("fanotify", "report('fanotify_init', sc('fanotify_init', 0, 0))"),
    (
        "capabilities back",
        "hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)\ndata = (ctypes.c_uint32 * 6)(0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff)\nreport('capset', sc('capset', hdr, data))\nreport('setuid', sc('setuid', 0))\nprint(open('/proc/self/status').read().split('CapEff:')[1].split()[0])",
    ),
    ("a setuid program", "!su -c 'id' root; sudo id; ping -c1 127.0.0.1"),
    (
        "TIOCSTI into a terminal",
        "import fcntl, termios, pty\nm, s = pty.openpty()\ntry: fcntl.ioctl(s, termios.TIOCSTI, b'x')\nexcept OSError as e: print(e.strerror)",
    ),
    (
        "seccomp and landlock from the cell",
        "report('seccomp', sc('seccomp', 1, 0, None))\nreport('landlock', sc('landlock_create_ruleset', None, 0, 1))",
    ),
    (
        "kexec and swap",
        "report('kexec', sc('kexec_load', 0, 0, None, 0))\nreport('swapon', sc('swapon', b'@WORK@/data.csv', 0))",
    ),
    (
        "personality and ldt",
        "report('personality', sc('personality', 0x0008))\nreport('modify_ldt', sc('modify_ldt', 1, ctypes.create_string_buffer(16), 16))",
    ),
    (
        "iopub through an inherited zmq context",
        "import zmq\nctx = zmq.Context.instance()\np = ctx.socket(zmq.PUB)\np.connect('tcp://127.0.0.1:@SHELL@')\np.send(b'FORGED @MARK@')\nprint('sent')",
    ),
    (
        "the kernel's history and the recorder's store",
        "hm = get_ipython().history_manager\nhm.db.execute(\"insert into history values (999, 1, 'FORGED', 'FORGED')\")\nhm.db.commit()\nimport sqlite3\nc = sqlite3.connect('@WORKROOT@/store.sqlite')\nc.execute('delete from executions'); c.commit()\nprint('done')",
    ),
    (
        "shut the kernel down from the preview",
        "get_ipython().kernel.do_shutdown(False)\nimport sys; sys.exit(0)",
    ),
    # -- files the kernel holds open for writing: the preview writes to its private copy ------
    (
        "copy: os.write through the inherited descriptor",
        "os.write(logf.fileno(), b'ESCAPED\\n')\nprint(open('@WORK@/append.log').read(), end='')",
    ),
    (
        "copy: seek and write at the kernel's offset",
        "print(rwf.tell(), end=' ')\nrwf.write(b'ESCAPED'); rwf.flush()\nf = open('@WORK@/rw.bin', 'rb'); f.seek(98); print(f.read(9))",
    ),
    (
        "copy: truncate and fsync",
        "rwf.truncate(10); rwf.flush(); os.fsync(rwf.fileno()); os.fdatasync(logf.fileno())\nos.sync(); libc.syncfs(rwf.fileno())\nprint(os.stat('@WORK@/rw.bin').st_size, os.fstat(rwf.fileno()).st_size)",
    ),
    (
        "copy: MAP_SHARED write and msync",
        "m = mmap.mmap(rwf.fileno(), 4096, mmap.MAP_SHARED)\nm[:7] = b'ESCAPED'; m.flush(); m.close()\nprint(open('@WORK@/rw.bin', 'rb').read(8))",
    ),
    (
        "copy: append mode kept",
        "import fcntl\nappend = bool(fcntl.fcntl(logf.fileno(), fcntl.F_GETFL) & os.O_APPEND)\nos.lseek(logf.fileno(), 0, 0); os.write(logf.fileno(), b'ESCAPED')\nprint(append, open('@WORK@/append.log').read())",
    ),
    (
        "copy: re-open through /proc/self/fd for writing",
        "for fd in (logf.fileno(), rwf.fileno()):\n    with open(f'/proc/self/fd/{fd}', 'w') as f: f.write('ESCAPED')\nprint(open('@WORK@/append.log').read())",
    ),
    (
        "copy: flock upgrade and unlock",
        "import fcntl\nfcntl.flock(rwf.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB); print('locked', end=' ')\nfcntl.flock(rwf.fileno(), fcntl.LOCK_UN); fcntl.flock(logf.fileno(), fcntl.LOCK_EX); print('unlocked')",
    ),
    (
        "copy: POSIX lock on the whole file",
        "import fcntl\nfcntl.lockf(rwf.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB); print('locked')\nimport time; time.sleep(0.5)",
    ),
    (
        "copy: descriptor flags changed",
        "import fcntl\nfcntl.fcntl(logf.fileno(), fcntl.F_SETFL, 0)\nfcntl.fcntl(rwf.fileno(), fcntl.F_SETFL, os.O_APPEND | os.O_NONBLOCK)\nprint(True)",
    ),
    (
        "copy: chmod and utime through the descriptor",
        "os.fchmod(rwf.fileno(), 0o600); os.utime(rwf.fileno(), (0, 0))\nprint(oct(os.stat('@WORK@/rw.bin').st_mode & 0o777))",
    ),
    (
        "copy: fallocate and copy_file_range into the copies",
        "os.posix_fallocate(rwf.fileno(), 0, 1 << 20)\nsrc = os.open('@WORK@/data.csv', os.O_RDONLY)\nos.copy_file_range(src, logf.fileno(), 4)\nprint(os.stat('@WORK@/rw.bin').st_size)",
    ),
    (
        "copy: io_submit write to the copy",
        "ctx = ctypes.c_ulong(0)\nreport('io_setup', sc('io_setup', 8, ctypes.byref(ctx)))\nbuf = ctypes.create_string_buffer(b'ESCAPED')\ncb = (ctypes.c_uint64 * 8)(0, 0, (1 << 32) | rwf.fileno(), ctypes.addressof(buf), 7, 0, 0, 0)\ncbs = (ctypes.c_void_p * 1)(ctypes.addressof(cb))\nreport('io_submit', sc('io_submit', ctx.value, 1, cbs))",
    ),
    (
        "copy: hard link and rename of the copy",
        "os.link('/proc/self/fd/%d' % rwf.fileno(), '@WORK@/@MARK@-link')\nos.rename('@WORK@/rw.bin', '@WORK@/@MARK@-moved')\nprint(sorted(os.listdir('@WORK@'))[:3])",
    ),
    # -- innocent cells that used to share an offset or a socket -----------------------------
    (
        "innocent: read the next line of an open file",
        "print(rf.readline(), end='')\nprint(os.lseek(rf.fileno(), 0, os.SEEK_CUR) > 0)",
    ),
    ("innocent: iterate an open file to its end", "print(sum(1 for _ in rf))"),
    ("innocent: seek an open file", "rf.seek(0)\nprint(rf.readline(), end='')"),
]
CELLS = [(n, c.replace("@WORKROOT@", "@WORK@/..")) for n, c in CELLS]
#: cells that must be stopped by the memory bound: they write hundreds of MB, which takes more
#: than 3 s on a loaded machine (they would be stopped by the timeout instead)
BOUNDED = {
    "memfd beyond the memory bound": 30.0,
    "memfd written, unmapped, beyond the bound": 30.0,
    "shm segments beyond the bound": 30.0,
    "socket buffers beyond the bound": 30.0,
    "memfd hidden behind a descriptor whose path cannot be read": 30.0,
    # (one CPU second, however loaded the machine)
    "a SIGXCPU handler of its own at the CPU bound": 60.0,
    "the CPU bound's stop caught and the loop goes on": 60.0,
}
#: cells that must be stopped by the CPU bound: their CPU seconds
CPU_SECONDS = {
    "a SIGXCPU handler of its own at the CPU bound": 1,
    "the CPU bound's stop caught and the loop goes on": 1,
}
#: how some cells must end (in what stopped them, or in their output)
EXPECT = {
    "write the open log": "kernel line\nESCAPED\n",
    "write through the read-write handle": "b'ESCAPEDRR'",
    "copy: os.write through the inherited descriptor": "kernel line\nESCAPED\n",
    "copy: seek and write at the kernel's offset": "100 b'RRESCAPED'",
    "copy: truncate and fsync": "10 10",
    "copy: MAP_SHARED write and msync": "b'ESCAPEDR'",
    "copy: append mode kept": "True kernel line\nESCAPED",
    "copy: re-open through /proc/self/fd for writing": "ESCAPED",
    "copy: flock upgrade and unlock": "locked unlocked",
    "copy: POSIX lock on the whole file": "locked",
    "copy: descriptor flags changed": "True",
    "copy: chmod and utime through the descriptor": "0o600",
    "the kernel's own TCP socket": "which the kernel holds open",
    "the kernel's socket shut down": "which the kernel holds open",
    "kill the kernel": "send a signal to process",
    "memfd beyond the memory bound": "use more than 512 MB of memory",
    "memfd written, unmapped, beyond the bound": "use more than 512 MB of memory",
    "shm segments beyond the bound": "use more than 512 MB of memory",
    "socket buffers beyond the bound": "use more than 512 MB of memory",
    "memfd hidden behind a descriptor whose path cannot be read": "use more than 512 MB of memory",
    "descriptors by the thousand in many processes slow the memory look past the deadline": (
        "run longer than 3 s"
    ),
    "a huge reply written to the reply pipe": "show more than 4 MB of output",
    "an 8 MB printed output": "show more than 4 MB of output",
    "an endless C-level loop ignoring signals": "run longer than 3 s",
    "a SIGXCPU handler of its own at the CPU bound": "use more than the preview's 1 CPU second",
    "the CPU bound's stop caught and the loop goes on": "use more than the preview's 1 CPU second",
    "a forged CPU-bound signal, then writes": "caught PreviewStopped",
    "escape the parent death signal and outlive the deadline": "run longer than 3 s",
    "TCP connect to the test's server": "open a network connection",
    "name lookup": "look up 'example.org' on the network",
    "System V shared memory left behind": "shmget 0",
    "POSIX message queue left behind": "mq True\n0",
    "libc write to every descriptor": "done",
    "innocent: read the next line of an open file": "line 1\nTrue",
    "innocent: iterate an open file to its end": "1999",
    "innocent: seek an open file": "line 0",
    "a forged reply of the wrong shapes written to the reply pipe": "x [I ServerApp] forged line",
    "innocent: a NaN in a display's metadata": "shown",
    "a lease on a file the kernel reads": "refused EPERM",
    "use up the user's inotify instances (shared with every process of the user)": "inotify 0 EPERM",
}


def test_the_hostile_suite_is_broad():
    assert len(CELLS) >= 80
    assert len({n for n, _ in CELLS}) == len(CELLS)


@pytest.mark.parametrize("name, cell", CELLS, ids=[n for n, _ in CELLS])
def test_no_escape(world, name, cell):
    k = world.kernel
    before = observe(world)
    last_error = k.value("repr(getattr(sys, 'last_value', None))")
    seen = len(k.iopub)
    limits: dict[str, Any] = {"timeout": BOUNDED.get(name, 3.0), "memory_mb": 512}
    if name in CPU_SECONDS:
        limits["cpu_seconds"] = CPU_SECONDS[name]
    reply = k.preview(world.fill(cell), **limits)
    # The cell ran (a broken test cell would prove nothing) and was not refused as a whole.
    assert reply.get("status") == "ok", reply
    broken = [
        o
        for o in reply["outputs"]
        if o["output_type"] == "error"
        and o["ename"] in ("SyntaxError", "NameError", "IndentationError", "ModuleNotFoundError")
    ]
    assert not broken, broken
    if name in EXPECT:
        assert EXPECT[name] in " ".join(reply["stopped"]) + text_of(reply), reply
    if "run longer than" in EXPECT.get(name, ""):
        # Stopped at its deadline, not whenever a look at its memory ended (27-33 s were seen
        # with a 5 s timeout): the kernel is held meanwhile. (Generous: a loaded machine.)
        assert reply["elapsed_ms"] < 1000 * (limits["timeout"] + 8), reply
    # (a write in flight from a process that got out has time to land; one that lives on, to
    # write later, is caught as a process: `observe` lists the kernel's children and any
    # process naming the mark)
    time.sleep(0.1)
    after = observe(world)
    diff = {key: (before[key], after[key]) for key in before if before[key] != after[key]}
    if diff and (world.work / "trap.log").exists():  # who sprang the trap, from where
        diff["trap.log"] = (world.work / "trap.log").read_text()[-6000:]
    assert after == before, json.dumps(diff, indent=1, default=str)
    # Nothing reached iopub but the previews' own busy/idle; the kernel answers as before.
    assert k.value("canary") == "'alive'"
    # (an error of the kernel's own formatting of the reply would be the person's %debug next)
    assert k.value("repr(getattr(sys, 'last_value', None))") == last_error
    foreign = [m for m in k.iopub[seen:] if m["msg_type"] != "status"]
    assert foreign == [], foreign
    assert not any(MARK in str(m["content"]) or "ESCAPED" in str(m["content"]) for m in k.iopub)
    print(name, "->", reply["stopped"] or text_of(reply)[-300:])


def test_nothing_lingers_after_the_suite(world):
    """Previews leave no process, IPC object, key or file behind, and the kernel's handles and
    memory are as they were."""
    time.sleep(0.5)
    state = observe(world)
    # (the kernel's children: multiprocessing's resource tracker, started by SharedMemory, and
    # perhaps the recorder's snapshot of the setup cell)
    assert state["processes"] == [] and state["stray"] == []
    assert set(state["children"]) <= set(world.children)
    assert MARK not in state["ipc"][0] and "7a7a7a" not in state["ipc"][0]
    assert (world.work / "append.log").read_text() == "kernel line\n"
    assert (world.work / "rw.bin").read_bytes() == b"R" * 4096
    assert (world.work / "mm.bin").read_bytes() == b"\0" * 4096
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    assert rt.mq_open(f"/{MARK}".encode(), os.O_RDONLY) == -1
    assert ctypes.get_errno() == errno.ENOENT
    # The kernel still holds every handle it had, at the same place.
    assert world.kernel.value("rf.readline()") == "'line 1\\n'"
    assert world.kernel.value("sock.fileno() > 0, sock.getblocking()") == "(True, True)"
    assert os.kill(world.kernel.pid, 0) is None
    assert signal.SIGKILL not in signal.sigpending()
    assert mmap.PAGESIZE > 0
