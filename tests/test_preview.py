"""Output preview in a real kernel: the isolated fork shows what a cell would print — files it
writes included — and leaves the namespace, the files, the network and the processes of the real
world as they were. (The attacker's view is tests/test_preview_hostile.py.)"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import psutil
import pytest

from jupyter_themisto.store import TrajectoryStore

from .helpers import running
from .preview_kernel import Kernel, kernel_for_path, namespaces, text_of

#: the two ways a preview is made: a root kernel forks it straight into its namespaces; a kernel
#: without CAP_SYS_ADMIN (any other user, a container's root) through a monitor that enters a
#: user namespace first. Every test of this module runs against both.
PATHS = ["direct", "monitor"]


@pytest.fixture(scope="module", params=PATHS)
def path(request):
    return request.param


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, path):
    return tmp_path_factory.mktemp(f"preview-{path}")


@pytest.fixture(scope="module")
def kernel(workdir, path):
    k = kernel_for_path(path, workdir / "store.sqlite", workdir)
    k.run("xs = [1, 2, 3]\nys = {'a': 1}\nimport pandas as pd\nimport numpy as np\n")
    yield k
    k.close()


def files(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `root` (the store excepted): mode and content."""
    return {
        str(p.relative_to(root)): (p.stat().st_mode, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file() and "store.sqlite" not in p.name and ".kernelspec" not in p.parts
    }


def test_every_isolation_layer_is_on(kernel, path):
    home = namespaces(kernel.pid)
    reply = kernel.preview("1 + 1")
    assert reply["status"] == "ok" and reply["stopped"] == []
    assert reply["path"] == path
    # No thread of the kernel was left in the preview's namespaces (the direct path's thread
    # enters them to fork, and leaves).
    assert namespaces(kernel.pid) == home
    assert reply["outputs"] == [
        {
            "output_type": "execute_result",
            "data": {"text/plain": "2"},
            "metadata": {},
            # the count the cell will have when it runs
            "execution_count": int(kernel.value("get_ipython().execution_count")),
        }
    ]
    layers = reply["sandbox"]
    for layer in (
        "namespaces",
        "filesystem",
        "descriptors",
        "shared_memory",
        "processes",
        "cpu",
        "capabilities",
        "landlock",
        "seccomp",
    ):
        assert layers[layer].startswith("on"), layers
    assert "user, mount, network, IPC, PID, UTS" in layers["namespaces"]
    # This Linux (6.18) has Landlock ABI >= 6: every kind of right is handled.
    assert "TCP bind/connect, signals, abstract unix sockets" in layers["landlock"], layers
    assert "truncate, device ioctls" in layers["landlock"]
    assert layers["memory"] == "watched by the kernel (1024 MB)"


def test_the_preview_is_alone_in_its_namespaces(kernel):
    reply = kernel.preview(
        "import os, socket\n"
        "print(os.getpid(), os.getppid())\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(sorted(os.listdir('/sys/class/net')))\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        f"print(os.getuid() == {os.getuid()}, socket.gethostname() == {socket.gethostname()!r})"
    )
    assert text_of(reply) == "1 0\n[1]\n['lo']\n0000000000000000\nTrue True\n", reply


def test_mutations_and_deletions_stay_in_the_fork(kernel):
    count = kernel.value("get_ipython().execution_count")
    reply = kernel.preview("xs.append(4)\ndel ys\nprint('mutated')\nxs")
    assert reply["stopped"] == []
    assert text_of(reply) == "mutated\n[1, 2, 3, 4]"
    assert kernel.value("xs") == "[1, 2, 3]"
    assert kernel.value("ys") == "{'a': 1}"
    # Neither counted nor recorded as an execution.
    assert kernel.value("get_ipython().execution_count") == count


def test_previews_are_not_recorded(kernel, workdir):
    kernel.preview("print('not recorded')")
    kernel.run("zz = 1")
    # The recorder writes after the reply: wait for the real cell, then look for the preview.
    deadline = time.monotonic() + 60
    while "zz = 1" not in (sources := _recorded_sources(workdir)):
        assert time.monotonic() < deadline, sources
        time.sleep(0.1)
    assert not any("not recorded" in s for s in sources)


def _recorded_sources(workdir: Path) -> list[str]:
    store = TrajectoryStore(str(workdir / "store.sqlite"))
    try:
        return [
            e["source"] for t in store.list_trajectories() for e in store.list_executions(t["id"])
        ]
    finally:
        store.close()


WRITING_CELLS = [
    # (setup run for real first, the cell previewed and then run for real)
    (
        "df = pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})",
        "df.to_csv('x.csv', index=False)\nprint(pd.read_csv('x.csv').b.tolist())\n"
        "print(open('x.csv').read())",
    ),
    ("", "np.savetxt('eye.txt', np.eye(2), fmt='%d')\n!cat eye.txt"),
    ("", "!head -3 data.csv"),
    ("", "!wc -l data.csv && sort -r data.csv | head -2"),
    (
        "",
        "import os, shutil\nos.mkdir('sub')\nshutil.copy('data.csv', 'sub/copy.csv')\n"
        "os.rename('sub/copy.csv', 'sub/moved.csv')\nprint(os.listdir('sub'))\n"
        "os.remove('data.csv')\nprint(os.path.exists('data.csv'))",
    ),
    ("", "with open('data.csv', 'a') as f:\n    f.write('9,9\\n')\n!tail -1 data.csv"),
    ("", "%%bash\necho from bash > b.txt\ncat b.txt"),
]


@pytest.mark.parametrize("setup, cell", WRITING_CELLS)
def test_cells_that_write_files_show_their_real_output(tmp_path, setup, cell):
    """The preview of a cell that writes files reads them back as the real run will, and
    nothing real changes; then the real run (same kernel state) shows the same text."""
    (tmp_path / "data.csv").write_text("a,b\n1,2\n3,4\n5,6\n")
    k = Kernel(tmp_path / "store.sqlite", tmp_path)
    try:
        k.run("import pandas as pd, numpy as np\n" + setup)
        before = files(tmp_path)
        reply = k.preview(cell)
        assert reply["status"] == "ok" and reply["stopped"] == [], reply
        assert files(tmp_path) == before
        real = k.run(cell)
        real_text = "".join(
            o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in real
        )
        assert text_of(reply) == real_text
        assert real_text.strip()
        if "head" not in cell and "wc" not in cell:
            assert files(tmp_path) != before  # (the real run did write)
    finally:
        k.close()


def test_c_level_calls_stay_inside(kernel, workdir):
    """C code bypasses Python's audit hooks: the namespaces and the overlay still hold."""
    target = workdir / "c-level.txt"
    marker = workdir / "spawned.txt"
    reply = kernel.preview(
        "import ctypes, os\nlibc = ctypes.CDLL(None)\n"
        f"fd = libc.open({str(target).encode()!r}, 0o101, 0o644)\n"  # O_WRONLY|O_CREAT
        "print(fd > 0, libc.write(fd, b'abc', 3))\n"
        f"print(libc.system(b'touch {marker}'), os.path.exists({str(marker)!r}))\n"
        f"print(open({str(target)!r}).read())\n"
    )
    assert text_of(reply) == "True 3\n0 True\nabc\n", reply
    assert not target.exists() and not marker.exists()


def test_a_file_open_for_writing_in_the_kernel_gets_a_private_copy(kernel, workdir):
    inherited = workdir / "open-handle.txt"
    kernel.run(
        f"fh = open({str(inherited)!r}, 'w')\nfh.write('kept'); fh.flush()\n"
        f"bh = open({str(inherited)!r}, 'r+b')\nhandles = [fh]"
    )
    before = (inherited.read_bytes(), inherited.stat().st_mtime_ns, inherited.stat().st_mode)
    offset = kernel.value("fh.tell(), bh.tell()")
    # The cell writes to its copy and reads back what it wrote, as the real run would.
    reply = kernel.preview(
        f"fh.write(' and more'); fh.flush()\nprint(open({str(inherited)!r}).read())\n"
        "import os\nos.write(handles[0].fileno(), b'!')\nbh.seek(0); bh.write(b'K')\n"
        "bh.truncate(2); bh.flush(); os.fsync(bh.fileno())\n"
        f"print(open({str(inherited)!r}).read(), fh.tell())"
    )
    assert reply["stopped"] == [], reply
    assert text_of(reply) == "kept and more\nKe 14\n", reply
    assert (
        "1 copied" in reply["sandbox"]["descriptors"]
        or "2 copied" in reply["sandbox"]["descriptors"]
    ), reply["sandbox"]
    after = (inherited.read_bytes(), inherited.stat().st_mtime_ns, inherited.stat().st_mode)
    assert after == before
    assert kernel.value("fh.tell(), bh.tell()") == offset
    kernel.run("fh.write('!'); fh.flush()")  # the kernel's own handle writes on where it was
    assert inherited.read_text() == "kept!"
    # A handle the namespace does not show (a descriptor only) is still a stub.
    kernel.run(f"import os\nraw = os.open({str(inherited)!r}, os.O_WRONLY)")
    reply = kernel.preview("os.write(raw, b'raw')")
    assert reply["stopped"] == [
        "use a descriptor the kernel holds open (a socket, a pipe or a file open for writing)"
    ], reply
    kernel.run("fh.close(); bh.close(); os.close(raw)")
    assert inherited.read_text() == "kept!"


def test_a_cell_that_waits_for_input_is_not_previewed(kernel):
    for cell in (
        "print('before')\nname = input('Your name? ')\nprint('hello', name)",
        "import getpass\npw = getpass.getpass('Password: ')",
    ):
        reply = kernel.preview(cell)
        assert reply["stopped"] == ["wait for input"], reply
        # (the cell itself, scrubbed, comes back for a fallback model)
        assert reply.pop("scrubbed_source") == cell
        assert "EOF" not in str(reply) and "Your name?" not in str(reply), reply
    assert kernel.value("'name' in dir(), 'pw' in dir()") == "(False, False)"


def _running_children(kernel) -> list[psutil.Process]:
    # (the recorder's finished snapshot children may linger as zombies)
    return [c for c in psutil.Process(kernel.pid).children(recursive=True) if running(c)]


def test_a_long_cell_is_previewed_to_its_end(kernel):
    # Longer than the old 5 s bound: the default lets a long cell run as it would.
    reply = kernel.preview("import time\ntime.sleep(5.5)\nprint('done')")
    assert reply["stopped"] == [] and text_of(reply) == "done\n", reply


def test_a_cancelled_preview_ends_at_once_with_all_its_processes(kernel):
    from jupyter_themisto.kernel.preview import cancel_preview

    deadline = time.monotonic() + 30
    while _running_children(kernel):  # the recorder's snapshot of the last real cell
        assert time.monotonic() < deadline, _running_children(kernel)
        time.sleep(0.05)
    assert not cancel_preview("nosuchpreview")
    token = "a" * 32
    cell = "import subprocess, time\np = subprocess.Popen(['sleep', '300'])\ntime.sleep(300)"
    expr = (
        "__import__('jupyter_themisto.kernel.preview', fromlist=['run_preview'])"
        f".run_preview({cell!r}, cancel={token!r})"
    )
    msg_id = kernel.kc.execute(
        "", silent=True, store_history=False, user_expressions={"p": expr}, allow_stdin=False
    )
    while not any("sleep" in c.name() for c in _running_children(kernel)):
        assert time.monotonic() < deadline, "the preview's process never started"
        time.sleep(0.05)
    started = time.monotonic()
    assert cancel_preview(token)
    while True:
        reply = kernel.kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    assert time.monotonic() - started < 10  # not the preview's 50 s timeout
    result = reply["content"]["user_expressions"]["p"]["data"]["application/json"]
    assert result["status"] == "cancelled", result
    deadline = time.monotonic() + 10
    while _running_children(kernel):  # the first process, its monitor and `sleep 300`
        assert time.monotonic() < deadline, _running_children(kernel)
        time.sleep(0.05)
    assert not cancel_preview(token)  # nothing listens any more
    assert kernel.value("xs") == "[1, 2, 3]"


def test_a_file_open_for_reading_reads_on_without_moving_the_kernels_offset(kernel, workdir):
    lines = "".join(f"line {i}\n" for i in range(5000))
    (workdir / "lines.txt").write_text(lines)
    kernel.run(f"rf = open({str(workdir / 'lines.txt')!r})\nfirst = rf.readline()")
    offset = kernel.value("rf.tell()")
    reply = kernel.preview("print(rf.readline(), end='')\nprint(len(rf.read()))")
    assert text_of(reply) == f"line 1\n{len(lines) - 14}\n", reply
    assert kernel.value("rf.tell()") == offset
    # The real handle reads on exactly where it was.
    assert kernel.value("rf.readline()") == "'line 1\\n'"


def test_network_connections_are_stopped(kernel):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        reply = kernel.preview(
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}))\ns.sendall(b'hi')"
        )
        assert reply["stopped"] == [f"open a network connection (('127.0.0.1', {port}))"]
        reply = kernel.preview(
            f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)"
        )
        assert reply["stopped"][0].startswith("open a network connection"), reply
        reply = kernel.preview("import socket\nsocket.getaddrinfo('example.org', 443)")
        assert reply["stopped"] == ["look up 'example.org' on the network"], reply
        # Below the audit hooks: a raw connect(2) through libc.
        reply = kernel.preview(
            "import ctypes, struct\nlibc = ctypes.CDLL(None)\nfd = libc.socket(2, 1, 0)\n"
            f"addr = struct.pack('=H', 2) + struct.pack('>H', {port}) + bytes([127, 0, 0, 1])"
            " + bytes(8)\n"
            "print(libc.connect(fd, addr, 16))"
        )
        assert text_of(reply) == "-1\n", reply
        time.sleep(0.5)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_processes_run_inside_the_namespaces_and_end_with_it(kernel, workdir):
    marker = workdir / "subprocess-ran.txt"
    seconds = f"{1000 + os.getpid() % 1000}.{time.time_ns() % 1000}"  # this test's own sleeper
    reply = kernel.preview(
        f"import subprocess, os\nsubprocess.run(['touch', {str(marker)!r}])\n"
        f"print(os.path.exists({str(marker)!r}))\n"
        f"subprocess.Popen(['sleep', {seconds!r}], start_new_session=True)\n"
        "print(subprocess.run(['ps', '-e', '-o', 'pid=,comm='], capture_output=True, text=True)"
        ".stdout.split())"
    )
    assert text_of(reply) == "True\n['1', 'python', '3', 'sleep', '4', 'ps']\n", reply
    assert not marker.exists()
    sleepers = [
        p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", seconds]
    ]
    # Killing the namespace's first process kills the rest; Linux does it asynchronously.
    _, alive = psutil.wait_procs(sleepers, timeout=10)
    assert alive == []


def test_endless_loop_is_killed_and_kernel_goes_on(kernel):
    reply = kernel.preview("n = 0\nwhile True:\n    n += 1", timeout=2.0)
    assert reply["stopped"] == ["run longer than 2 s"]
    assert kernel.run("print(xs)") == [
        {"msg_type": "stream", "name": "stdout", "text": "[1, 2, 3]\n"}
    ]
    assert "n" not in kernel.value("sorted(k for k in globals() if k == 'n')")


def test_the_cpu_bound_stops_the_preview_and_says_so(kernel):
    # (the preview's first process is PID 1 of its namespace, which ignores the soft limit's
    # SIGXCPU unless it has a handler: it was killed a second later, with its outputs, and said
    # "crash the kernel (signal SIGKILL)")
    loop = "print('started')\nn = 0\nwhile True:\n    n += 1"
    reply = kernel.preview(loop, cpu_seconds=1, timeout=60.0)
    assert reply["stopped"] == ["use more than the preview's 1 CPU second"], reply
    assert reply["cpu_bound"] == 1 and text_of(reply) == "started\n"
    # A cell that ignores SIGXCPU is killed at the hard limit: the kernel tells the bound from
    # the CPU time the process used.
    reply = kernel.preview(
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n" + loop,
        cpu_seconds=1,
        timeout=60.0,
    )
    assert reply["stopped"] == ["use more than the preview's 1 CPU second"], reply
    assert reply["cpu_bound"] == 1
    assert kernel.value("'n' in globals()") == "False"


def test_memory_beyond_the_limit_is_stopped(kernel):
    # Filled memory (b"x" * n touches every page; bytes(n) would stay lazily unmapped).
    reply = kernel.preview("chunks = [b'x' * 2**26 for _ in range(200)]", memory_mb=256)
    assert reply["stopped"] == ["use more than 256 MB of memory"], reply
    reply = kernel.preview("big = b'x' * (64 * 2**30)\nlen(big)", memory_mb=256)
    assert reply["stopped"][0].startswith("use more than"), reply
    # Memory outside the process: a memfd, files in the private overlay, /dev/shm.
    fill = "for _ in range(200):\n    f.write(b'x' * 2**22)"
    for cell in (
        "import os\nf = open(os.memfd_create('m'), 'wb')\n" + fill,
        "f = open('fill.bin', 'wb')\n" + fill,
        "f = open('/dev/shm/fill', 'wb')\n" + fill,
    ):
        reply = kernel.preview(cell + "\nimport time; time.sleep(3)", memory_mb=256)
        assert reply["stopped"] in (
            ["use more than 256 MB of memory"],
            [],  # the file system filled up first (ENOSPC), within the bound
        ), reply
        if not reply["stopped"]:
            assert "No space left on device" in text_of(reply), reply
    assert kernel.value("'big' in globals() or 'chunks' in globals()") == "False"


def test_child_prints_never_reach_the_persons_cells(kernel):
    seen = len(kernel.iopub)
    reply = kernel.preview(
        "import os, sys\nprint('LEAK-print')\nos.write(1, b'LEAK-fd1\\n')\n"
        "os.write(2, b'LEAK-fd2\\n')\nsys.__stdout__.write('LEAK-dunder\\n')\n"
        "sys.__stdout__.flush()"
    )
    assert text_of(reply) == "LEAK-print\n"
    outputs = kernel.run("print('after')")
    assert outputs == [{"msg_type": "stream", "name": "stdout", "text": "after\n"}]
    time.sleep(0.5)
    kernel.run("pass")
    assert not any("LEAK" in str(m["content"]) for m in kernel.iopub[seen:])


def test_dataframe_head_equals_the_real_output_byte_for_byte(kernel):
    kernel.run(
        "rng = np.random.default_rng(0)\n"
        "df = pd.DataFrame(rng.normal(size=(50, 4)), columns=list('abcd'))\n"
        "df['name'] = ['row %d' % i for i in range(50)]"
    )
    reply = kernel.preview("df.head()")
    real = kernel.run("df.head()")
    assert len(real) == 1 and real[0]["msg_type"] == "execute_result"
    assert len(reply["outputs"]) == 1
    assert reply["outputs"][0]["data"] == real[0]["data"]
    assert (
        reply["outputs"][0]["data"]["text/plain"].encode() == real[0]["data"]["text/plain"].encode()
    )
    # Streams, displays, the trailing semicolon and errors follow IPython too.
    cell = "print('a')\nfrom IPython.display import display\ndisplay(df.shape)\ndf.shape"
    real = kernel.run(cell)
    got = kernel.preview(cell)["outputs"]
    assert [o["output_type"] for o in got] == ["stream", "display_data", "execute_result"]
    assert got[0]["text"] == real[0]["text"]
    assert got[1]["data"] == real[1]["data"] and got[2]["data"] == real[2]["data"]
    assert kernel.preview("df.shape;")["outputs"] == []
    err = kernel.preview("1 / 0")["outputs"]
    assert err[0]["ename"] == "ZeroDivisionError" and err[0]["evalue"] == "division by zero"


def test_threads_blas_and_plots_work(kernel):
    reply = kernel.preview(
        "from concurrent.futures import ThreadPoolExecutor\n"
        "with ThreadPoolExecutor(4) as ex:\n    print(sum(ex.map(lambda i: i * i, range(100))))\n"
        "a = np.arange(400 * 400, dtype=float).reshape(400, 400) / 1e5\n"
        "print(round(float((a @ a.T).trace()), 3))"
    )
    a = [[i * 400 + j for j in range(400)] for i in range(400)]
    trace = sum(v * v for row in a for v in row) / 1e10
    assert text_of(reply) == f"328350\n{round(trace, 3)}\n", reply
    reply = kernel.preview(
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
    )
    images = [o for o in reply["outputs"] if "image/png" in o.get("data", {})]
    assert len(images) == 1 and reply["stopped"] == [], reply


def test_interrupting_the_kernel_kills_the_preview(kernel):
    expr = (
        "__import__('jupyter_themisto.kernel.preview', fromlist=['run_preview'])"
        ".run_preview('while True: pass', timeout=60.0)"
    )
    proc = psutil.Process(kernel.pid)

    def running_children() -> list:
        # (the recorder's finished snapshot children may linger as zombies)
        return [c for c in proc.children() if running(c)]

    deadline = time.monotonic() + 30
    while running_children():  # the recorder's snapshot of the last real cell
        assert time.monotonic() < deadline, running_children()
        time.sleep(0.05)
    msg_id = kernel.kc.execute(
        "", silent=True, store_history=False, user_expressions={"p": expr}, allow_stdin=False
    )
    while not running_children():  # the preview's first process (or its monitor)
        assert time.monotonic() < deadline, "the preview never started"
        time.sleep(0.05)
    time.sleep(0.5)
    started = time.monotonic()
    kernel.km.interrupt_kernel()
    while True:
        reply = kernel.kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    assert time.monotonic() - started < 20  # not the preview's 60 s timeout
    assert reply["content"]["user_expressions"]["p"]["ename"] == "KeyboardInterrupt"
    deadline = time.monotonic() + 10
    while running_children():
        assert time.monotonic() < deadline, running_children()
        time.sleep(0.05)
    assert kernel.value("xs") == "[1, 2, 3]"


LAUNCHER = """
import errno, os, sys
import pyseccomp as sc
f = sc.SyscallFilter(defaction=sc.ALLOW)
for name in os.environ["DENY_SYSCALLS"].split(","):
    f.add_rule(sc.ERRNO(errno.EPERM), name)
f.load()
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


@pytest.mark.parametrize(
    "deny, lacks",
    [
        (
            "unshare",
            "new user, mount, network, IPC, PID and UTS namespaces (Operation not permitted)",
        ),
        ("landlock_create_ruleset", "Landlock (Linux >= 5.13 with Landlock enabled)"),
        ("mount", "a private copy-on-write root (mount"),
    ],
)
def test_a_linux_without_a_layer_previews_nothing(tmp_path, deny, lacks):
    """A kernel where Linux refuses one of the layers (here: seccomp denies its system call to
    the whole kernel, as a container runtime might) runs no cell in a preview, and says why."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    k = Kernel(tmp_path / "store.sqlite", tmp_path, launcher=launcher, DENY_SYSCALLS=deny)
    try:
        reply = k.preview("open('written.txt', 'w').write('x'); print('ran')")
        assert reply.get("status") == "unsupported" and reply["outputs"] == [], reply
        assert reply["detail"].startswith("preview unavailable: this Linux lacks " + lacks), reply
        assert not (tmp_path / "written.txt").exists()
    finally:
        k.close()


def test_a_kernel_without_libseccomp_previews_nothing(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pyseccomp.py").write_text("raise ImportError('no libseccomp here')\n")
    k = Kernel(tmp_path / "store.sqlite", tmp_path, PYTHONPATH=str(shadow))
    try:
        reply = k.preview("open('written.txt', 'w').write('x'); print('ran')")
        assert reply["status"] == "unsupported" and reply["outputs"] == []
        assert reply["detail"] == (
            "preview unavailable: this Linux lacks seccomp (libseccomp: ImportError: "
            "no libseccomp here)"
        ), reply
        assert not (tmp_path / "written.txt").exists()
    finally:
        k.close()


def test_figures_follow_the_result_and_warnings_name_the_kernels_cell_file(kernel):
    """As in the real run: the inline backend's figure comes after the cell's result, and a
    warning's path is the kernel's cell file (with the kernel's pid), not the preview's."""
    kernel.run("%matplotlib inline\nimport matplotlib.pyplot as plt")
    cell = "plt.plot([1, 2]); plt.title('t')\n42"
    preview = kernel.preview(cell)["outputs"]
    real = kernel.run(cell)
    assert [o["output_type"] for o in preview] == ["execute_result", "display_data"]
    assert [o["msg_type"] for o in real] == ["execute_result", "display_data"]
    assert preview[0]["data"]["text/plain"] == real[0]["data"]["text/plain"] == "42"
    cell = "import warnings\nwarnings.warn('careful')"
    preview_text = text_of(kernel.preview(cell))
    real_text = "".join(o.get("text", "") for o in kernel.run(cell))
    assert f"ipykernel_{kernel.pid}" in real_text
    assert preview_text == real_text
