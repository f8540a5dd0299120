"""Builds a preview child's private view of the filesystem: every real filesystem behind a
copy-on-write overlay whose upper layer lives on a small tmpfs, a fresh /proc, a minimal /dev and a
read-only /sys; then makes it the child's root. What a cell writes there is real for the cell
(`df.to_csv("x.csv")` then `pd.read_csv("x.csv")`, `!cat x.csv`) and gone when the child exits.

Runs in the child only, as the first process of new mount and PID namespaces. Two ways:
- `whole`: the child of a privileged kernel (see `sandbox.fork_into_namespaces`), still in the
  kernel's user namespace: its copy of the mounts is not locked, so one overlay takes the whole
  root file system, and one more each other file system mounted in it;
- otherwise the child is already in a user namespace of its own (`sandbox.enter_namespaces`): the
  mounts it copied from the kernel's mount namespace are locked (they came from a more privileged
  user namespace), and an overlay cannot take a directory with a locked mount beneath it as its
  lower layer, so the tree is built directory by directory — an overlay for each directory with
  no mount beneath it, a skeleton directory (recursed into) for the others.
"""

from __future__ import annotations

import ctypes
import os
import re
import stat
from dataclasses import dataclass, field

from ._linux import check, libc, syscall

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (new syscalls share a table)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

#: where the scratch tmpfs is mounted while the tree is built (in the child's own mount namespace)
STAGING = "/tmp"
#: file systems holding data: each gets a copy-on-write overlay
_PSEUDO = {
    "proc",
    "sysfs",
    "cgroup",
    "cgroup2",
    "devpts",
    "devtmpfs",
    "mqueue",
    "debugfs",
    "tracefs",
    "securityfs",
    "bpf",
    "pstore",
    "configfs",
    "fusectl",
    "binfmt_misc",
    "hugetlbfs",
    "autofs",
    "efivarfs",
    "selinuxfs",
    "nsfs",
    "rpc_pipefs",
}
#: the devices a computation may use (bound from the kernel's /dev, read-only mounts)
_DEVICES = ("null", "zero", "full", "random", "urandom")
#: made afresh in every private root (their mounts in the kernel's tree are not copied)
_FRESH = ("/proc", "/dev", "/sys")
#: parts of the fresh /proc that change the whole machine, kept read-only (Landlock refuses
#: every write under /proc anyway)
_PROC_READ_ONLY = ("sys", "sysrq-trigger")


@dataclass
class PrivateRoot:
    """What the child needs to know about its new root after `build`."""

    #: directories (paths in the new root) whose content the cell may change: the overlays
    writable: list[str] = field(default_factory=list)
    #: the devices of the private /dev a cell may read and write (/dev/null…)
    devices: list[str] = field(default_factory=list)
    #: an O_PATH descriptor of the scratch tmpfs (uppers, /dev/shm): the kernel reads its usage
    scratch_fd: int = -1
    #: directories that could not be overlaid and are read-only instead, with the reason
    read_only: dict[str, str] = field(default_factory=dict)


class _Mounts:
    """The kernel's mount table as seen by the child, by mount point (the topmost mount only)."""

    def __init__(self) -> None:
        rows = []
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                f = left.split()
                rows.append((int(f[0]), int(f[1]), _unescape(f[4]), right.split()[0]))
        ids_at: dict[str, list[tuple[int, int, str]]] = {}
        for mid, parent, point, fstype in rows:
            ids_at.setdefault(point, []).append((mid, parent, fstype))
        self.fstype: dict[str, str] = {}
        for point, mounts in ids_at.items():
            parents = {p for _, p, _ in mounts}
            top = [m for m in mounts if m[0] not in parents] or mounts
            self.fstype[point] = top[-1][2]
        self.points = sorted(self.fstype)

    def below(self, path: str) -> bool:
        """Whether a mount lies strictly beneath `path`."""
        prefix = path.rstrip("/") + "/"
        return any(p.startswith(prefix) for p in self.points)


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    check(
        libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {fstype or source} on {target}",
    )


def _set_read_only(target: str) -> None:
    """Make the mount at `target` and every mount beneath it read-only, nosuid, noexec (and
    nodev, except where devices are the point)."""
    flags = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC
    if not target.endswith("/dev"):
        flags |= MOUNT_ATTR_NODEV
    attr = (ctypes.c_uint64 * 4)(flags, 0, 0, 0)
    check(
        syscall(SYS_MOUNT_SETATTR, -100, target.encode(), AT_RECURSIVE, attr, 32),
        f"mount_setattr read-only {target}",
    )


def _read_only_bind(source: str, target: str, *, recursive: bool, extra: int = 0) -> None:
    _mount(source, target, None, MS_BIND | (MS_REC if recursive else 0))
    if recursive:
        _set_read_only(target)
    else:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | extra)


class _Builder:
    def __init__(self, mounts: _Mounts, scratch: str, staging_fd: int) -> None:
        self.mounts = mounts
        self.scratch = scratch
        self.staging_fd = staging_fd
        self.count = 0
        self.root = PrivateRoot()

    def overlay(self, lower_fd: int, target: str, new_path: str) -> None:
        n = self.count
        self.count += 1
        upper, work = f"{self.scratch}/u/{n}", f"{self.scratch}/w/{n}"
        os.mkdir(upper)
        os.mkdir(work)
        st = os.fstat(lower_fd)
        _copy_owner_and_mode(st, upper)
        _mount(
            "overlay",
            target,
            "overlay",
            MS_NOSUID | MS_NODEV,
            f"lowerdir=/proc/self/fd/{lower_fd},upperdir={upper},workdir={work},userxattr",
        )
        self.root.writable.append(new_path)

    def mounted(self, point: str, fd: int, target: str) -> None:
        """(whole) Show in `target` (a path of the root overlay) the file system the kernel sees
        mounted at `point` (`fd`: its root, opened before the scratch tmpfs covered anything)."""
        fstype = self.mounts.fstype.get(point, "")
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            # A file mounted over a file (a container's /etc/hosts…): the real one, read-only.
            _read_only_bind(f"/proc/self/fd/{fd}", target, recursive=False, extra=MS_NODEV)
            return
        if fstype in _PSEUDO:
            _read_only_bind(f"/proc/self/fd/{fd}", target, recursive=False, extra=MS_NODEV)
            self.root.read_only[point] = f"a {fstype} file system"
            return
        try:
            self.overlay(fd, target, point)
        except OSError as e:
            _read_only_bind(f"/proc/self/fd/{fd}", target, recursive=False, extra=MS_NODEV)
            self.root.read_only[point] = str(e)

    def directory(self, host: str, dir_fd: int, target: str) -> None:
        """Fill `target` (an empty directory of the skeleton) with the entries of `host`."""
        for name in os.listdir(dir_fd):
            path = os.path.join(host, name)
            new_path = path
            dst = os.path.join(target, name)
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=dir_fd), dst)
                continue
            if not stat.S_ISDIR(st.st_mode):
                # A file beside a mount point: the real one, read-only (overlays take directories).
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                try:
                    with open(dst, "w"):
                        pass
                    _read_only_bind(f"/proc/self/fd/{fd}", dst, recursive=False, extra=MS_NODEV)
                finally:
                    os.close(fd)
                continue
            os.mkdir(dst)
            fstype = self.mounts.fstype.get(path)
            if path in ("/proc", "/dev", "/sys") or fstype in ("proc", "sysfs", "devtmpfs"):
                continue  # made afresh by the caller
            if path == STAGING:  # covered by the scratch tmpfs: the real one, opened before
                fd = os.dup(self.staging_fd)
            else:
                fd = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
                )
            try:
                if fstype is not None and fstype in _PSEUDO:
                    _read_only_bind(f"/proc/self/fd/{fd}", dst, recursive=True)
                    self.root.read_only[new_path] = f"a {fstype} file system"
                elif self.mounts.below(path):
                    _copy_owner_and_mode(st, dst)  # (no overlay on it: the skeleton shows)
                    self.directory(path, fd, dst)
                else:
                    try:
                        self.overlay(fd, dst, new_path)
                    except OSError as e:
                        # (a file system overlayfs does not take as a lower layer)
                        _copy_owner_and_mode(st, dst)
                        _read_only_bind(f"/proc/self/fd/{fd}", dst, recursive=True)
                        self.root.read_only[new_path] = str(e)
            finally:
                os.close(fd)


def _copy_owner_and_mode(st: os.stat_result, path: str) -> None:
    try:
        os.chown(path, st.st_uid, st.st_gid)
    except OSError:
        pass  # an owner outside the user namespace's map
    os.chmod(path, stat.S_IMODE(st.st_mode))


def _fresh_dev(dev: str, scratch: str) -> list[str]:
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    devices = [name for name in _DEVICES if os.path.exists(f"/dev/{name}")]
    for name in devices:
        with open(f"{dev}/{name}", "w"):
            pass
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, to in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ):
        os.symlink(to, f"{dev}/{name}")
    for name in ("shm", "mqueue", "pts"):
        os.mkdir(f"{dev}/{name}")
    # /dev and the kernel's devices in it read-only in one call (the devices' modes and owners
    # are the kernel's; reading and writing a device is not a change of its file system).
    _set_read_only(dev)
    os.mkdir(f"{scratch}/shm", 0o1777)
    os.chmod(f"{scratch}/shm", 0o1777)
    _mount(f"{scratch}/shm", f"{dev}/shm", None, MS_BIND)
    # POSIX message queues of its own IPC namespace (a Landlock rule needs them in the tree).
    _mount("mqueue", f"{dev}/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # A terminal of its own (IPython runs `!cmd` under a pseudo-terminal).
    _mount(
        "devpts",
        f"{dev}/pts",
        "devpts",
        MS_NOSUID | MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=620",
    )
    return [f"/dev/{name}" for name in devices]


def _fresh_proc(proc: str, sysctls: dict[str, str]) -> dict[str, str]:
    _mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    failed = {}
    for name, value in sysctls.items():
        try:
            with open(f"{proc}/sys/{name}", "w") as fh:
                fh.write(value)
        except OSError as e:
            failed[name] = e.strerror or str(e)
    for name in _PROC_READ_ONLY:
        path = f"{proc}/{name}"
        if os.path.exists(path):
            _read_only_bind(path, path, recursive=True)
    return failed


def build(
    *, scratch_bytes: int, sysctls: dict[str, str], whole: bool = False
) -> tuple[PrivateRoot, dict[str, str]]:
    """Make a private copy-on-write root and enter it (chroot-like, via pivot_root); the
    process's working directory stays the same path. Returns the root's description and the
    namespace settings (`sysctls`, relative to /proc/sys) that could not be written. `whole`: the
    mounts are not locked (see the module's docstring).

    Raises OSError naming the step when the running Linux does not allow one.
    """
    cwd = os.getcwd()
    # Nothing mounted here may propagate back to the kernel's mount namespace.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    mounts = _Mounts()
    root_fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    staging_fd = os.open(STAGING, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    points: dict[str, int] = {}
    try:
        if whole:
            # Every other file system the kernel sees, parents first, opened before the scratch
            # tmpfs covers STAGING (the kernel's /tmp may be one of them).
            for point in mounts.points:
                if point == "/" or any(point == f or point.startswith(f + "/") for f in _FRESH):
                    continue
                try:
                    points[point] = os.open(point, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
                except OSError:
                    continue  # (covered by a later mount, or not readable)
        # The staging directory is covered by the scratch tmpfs below; the overlays reach the
        # real one through root_fd.
        _mount(
            "themisto-preview",
            STAGING,
            "tmpfs",
            MS_NOSUID | MS_NODEV,
            f"size={scratch_bytes},mode=700",
        )
        scratch = STAGING
        for d in ("root", "u", "w"):
            os.mkdir(f"{scratch}/{d}")
        new = f"{scratch}/root"
        builder = _Builder(mounts, scratch, staging_fd)
        if whole:
            builder.overlay(root_fd, new, "/")
            for point, fd in points.items():
                target = new + point
                if os.path.lexists(target):
                    builder.mounted(point, fd, target)
            # Landlock grants changes beneath these (not beneath /, which holds /proc and /dev).
            builder.root.writable = [
                f"/{e.name}"
                for e in os.scandir(new)
                if e.is_dir(follow_symlinks=False) and f"/{e.name}" not in _FRESH
            ]
        else:
            _copy_owner_and_mode(os.fstat(root_fd), new)
            _mount(new, new, None, MS_BIND)  # pivot_root wants a mount point
            builder.directory("/", root_fd, new)
    finally:
        for fd in (root_fd, staging_fd, *points.values()):
            os.close(fd)
    root = builder.root
    for name in ("proc", "dev", "sys"):
        if not os.path.isdir(f"{new}/{name}"):
            os.mkdir(f"{new}/{name}", 0o755)
    failed = _fresh_proc(f"{new}/proc", sysctls)
    devices = _fresh_dev(f"{new}/dev", scratch)
    try:
        _mount("sysfs", f"{new}/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        _read_only_bind("/sys", f"{new}/sys", recursive=True)
    root.writable += ["/dev/shm", "/dev/mqueue"]
    root.devices = devices
    root.scratch_fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    os.chdir(new)
    arch = os.uname().machine
    if arch not in SYS_PIVOT_ROOT:
        raise OSError(0, f"pivot_root: unknown system call number on {arch}")
    check(syscall(SYS_PIVOT_ROOT[arch], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount the kernel's root")
    os.chdir("/")
    if not whole:
        # The skeleton itself (the directories holding the overlays) does not change.
        _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    try:
        os.chdir(cwd)
    except OSError:
        pass  # the working directory was deleted in the kernel: stay at /
    return root, failed
