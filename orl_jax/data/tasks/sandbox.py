"""Run untrusted Python (model-written or generated programs) in a separate, resource-limited subprocess.

What one run does, in order:
  1. Creates a private temporary directory (the child's cwd), writes the source there, opens stdout/stderr files
     there (output goes to files, not pipes, so a program that prints forever fills at most RLIMIT_FSIZE bytes
     instead of the parent's memory).
  2. Starts `[unshare --net --] python -I -S -B -c BOOTSTRAP ...` with an empty environment, stdin from /dev/null,
     no inherited file descriptors, in a new session (its own process group). `unshare --net` puts the child in a
     fresh network namespace with no interfaces (not even a working loopback); it is used when this host permits
     it (root, or unprivileged user namespaces: `unshare --user --map-root-user --net`), probed once per process,
     and silently left out otherwise (see `network_namespace_available()`).
  3. The bootstrap (our code, running before any untrusted code) sets resource limits with resource.setrlimit:
     CPU seconds, address space (memory), file size, open files, no core dumps, and RLIMIT_NPROC = 0 (no new
     processes or threads); then, when the parent runs as real root, drops to uid/gid 65534 (nobody), which also
     makes RLIMIT_NPROC effective (root ignores it) and takes away write access to everything root owns; then
     replaces socket.socket / create_connection / getaddrinfo / ... (in `_socket`, so also in a `socket` module
     imported later, and in `socket` itself when the source imports it) and os/posix fork / exec* / spawn* /
     system / kill with functions that raise, hides and blocks imports of process and network modules
     (subprocess, multiprocessing, ctypes, asyncio, ssl, urllib, http, importlib, ...), and only then compiles
     and runs the untrusted source as `__main__`. (Allowlisted pure stdlib modules that the source imports are
     imported before the uid drop, since the stdlib itself may be unreadable to nobody.)
  4. The parent waits with a wall-clock timeout and on expiry SIGKILLs the whole process group.

Why the limits are set by the bootstrap rather than in `preexec_fn`: the trainer that calls this is a
multi-threaded JAX process, and `preexec_fn` runs Python between fork and exec, which the subprocess docs say can
deadlock in a threaded parent. Everything the parent does here goes through the C fork/exec path, so it is safe
to call from many threads at once (`run_many`). The limits are in place before a single untrusted byte runs.

What it protects against: accidental or casual damage by generated code: infinite loops, runaway memory, fork
bombs, huge outputs, stray network calls (also at the OS level when the namespace is available), writes outside
the scratch directory when the parent is root (the child runs as nobody), leftover processes.

What it does NOT protect against (this is not a security boundary against a determined attacker):
  - The Python-level guards can be undone from inside Python (e.g. reaching the original socket type through
    `object.__subclasses__()`; tests/test_tasks.py shows the network namespace stopping exactly that); they are a
    first line, not a wall. Only the network namespace, the rlimits and the uid
    drop are enforced by the kernel, and each applies only where the host allows it.
  - No filesystem isolation: the child can read every file that its uid can read (as nobody: world-readable
    files; when the parent is not root, everything the parent's user can read and write). RLIMIT_FSIZE caps each
    file, not their number: a run can fill the scratch directory (deleted afterwards) until its timeout.
  - No seccomp / syscall filtering, no mount, pid or IPC namespaces, no cgroup; kernel or interpreter bugs are in
    scope for an attacker. Without a network namespace, raw syscalls (e.g. via a crafted bytecode/ctypes escape)
    can still reach the network.
For anything adversarial, run this inside a container or VM (gVisor, Firecracker, nsjail) as well.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NOBODY = 65534
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 512
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
FILE_SIZE_LIMIT_BYTES = 4 * 1024 * 1024  # any file the child writes, stdout/stderr included

# Modules untrusted code may not import (top-level names). Network modules are blocked on top of the patched
# socket functions so the failure is an immediate, readable ImportError.
DENIED_MODULES = (
    "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing", "concurrent", "ctypes", "_ctypes",
    "pty", "asyncio", "ssl", "_ssl", "socketserver", "http", "urllib", "ftplib", "smtplib", "poplib", "imaplib",
    "telnetlib", "xmlrpc", "webbrowser", "importlib", "runpy", "signal", "_signal", "resource",
)
# Standard-library modules that untrusted code may import even though, after the uid drop, the interpreter's own
# stdlib can be unreadable (e.g. a Python installed under /root): the bootstrap scans the source's import statements
# and imports the ones named here while still privileged. Importing everything up front instead would add ~20 ms
# to every run; allowlisting keeps privileged imports to modules with no side effects. (socket is here so that its
# guards are installed on the real module, on hosts where nobody could not import it later anyway.)
PRELOADABLE_MODULES = (
    "__future__", "abc", "array", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal",
    "enum", "fractions", "functools", "heapq", "io", "itertools", "json", "math", "numbers", "operator", "pprint",
    "random", "re", "socket", "statistics", "string", "struct", "textwrap", "time", "traceback", "typing",
    "unicodedata",
)

# argv: source path, cpu seconds, address-space bytes, file-size bytes, drop-to-nobody flag. Kept free of imports
# beyond what the guards need (each stdlib import costs start-up time on every run).
_BOOTSTRAP = r"""
import os, posix, resource, sys
_path, _cpu, _mem, _fsize, _drop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
with open(_path, encoding="utf-8") as _f:
    _src = _f.read()
def _limit(which, value, hard=None):
    try:
        resource.setrlimit(which, (value, value if hard is None else hard))
    except (ValueError, OSError):
        pass
_limit(resource.RLIMIT_CPU, _cpu, _cpu + 1)
_limit(resource.RLIMIT_AS, _mem)
_limit(resource.RLIMIT_FSIZE, _fsize)
_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_NOFILE, 64)
_limit(resource.RLIMIT_NPROC, 0)
_preloadable = frozenset(__PRELOAD__)
for _line in _src.replace(";", "\n").splitlines():
    _w = _line.strip().split()
    if len(_w) >= 2 and _w[0] in ("import", "from"):
        for _m in (_w[1:2] if _w[0] == "from" else " ".join(_w[1:]).split(",")):
            _m = _m.strip().split(" ")[0].split(".")[0]
            if _m in _preloadable:
                try:
                    __import__(_m)
                except Exception:
                    pass
import _socket
if _drop == "1":
    os.setgroups([])
    os.setgid(__NOBODY__)
    os.setuid(__NOBODY__)
def _no_network(*a, **k):
    raise PermissionError("network access is disabled in the sandbox")
def _no_process(*a, **k):
    raise PermissionError("process creation and signals are disabled in the sandbox")
class _NoSocket:
    # a slot-less class, not a function, so that a later `import socket` (class socket(_socket.socket) with
    # __slots__) still imports, with every way to make a socket raising
    __slots__ = ()
    def __new__(cls, *a, **k):
        _no_network()
for _m in (_socket, sys.modules.get("socket")):
    for _n in ("socket", "SocketType", "create_connection", "create_server", "getaddrinfo", "getnameinfo",
               "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "socketpair", "fromfd", "fromshare"):
        if _m is not None and hasattr(_m, _n):
            setattr(_m, _n, _NoSocket if _n in ("socket", "SocketType") else _no_network)
for _m in (os, posix):
    for _n in ("system", "popen", "fork", "forkpty", "register_at_fork", "kill", "killpg", "posix_spawn",
               "posix_spawnp", "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
               "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe"):
        if hasattr(_m, _n):
            setattr(_m, _n, _no_process)
_denied = frozenset(__DENIED__)
class _DenyImports:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _denied:
            raise ImportError("import of %r is disabled in the sandbox" % name)
        return None
sys.meta_path.insert(0, _DenyImports)
for _n in list(sys.modules):
    if _n.partition(".")[0] in _denied:
        del sys.modules[_n]
def _report(e, lines):
    # a traceback without the traceback module (not imported, to keep start-up fast)
    out = []
    if isinstance(e, SyntaxError) and e.filename == "<sandbox>":
        out.append('  File "<sandbox>", line %s' % e.lineno)
        if e.text:
            out.append("    " + e.text.strip())
        out.append("%s: %s" % (type(e).__name__, e.msg))
    else:
        out.append("Traceback (most recent call last):")
        tb = e.__traceback__.tb_next
        while tb is not None:
            co = tb.tb_frame.f_code
            out.append('  File "%s", line %s, in %s' % (co.co_filename, tb.tb_lineno, co.co_name))
            if co.co_filename == "<sandbox>" and tb.tb_lineno and 0 < tb.tb_lineno <= len(lines):
                out.append("    " + lines[tb.tb_lineno - 1].strip())
            tb = tb.tb_next
        try:
            msg = str(e)[:2000]
        except BaseException:
            msg = "<unprintable>"
        out.append(type(e).__name__ + (": " + msg if msg else ""))
    sys.stderr.write("\n".join(out) + "\n")
_globals = {"__name__": "__main__", "__builtins__": __builtins__}
_lines = _src.splitlines()
try:
    _code = compile(_src, "<sandbox>", "exec")
    del _src, _f, _m, _n, _path, _line, _w
    exec(_code, _globals)
except SystemExit:
    raise
except BaseException as _e:
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    try:
        _report(_e, _lines)
        sys.stderr.flush()
    finally:
        os._exit(1)
sys.stdout.flush()
"""
_BOOTSTRAP = (_BOOTSTRAP.replace("__PRELOAD__", repr(PRELOADABLE_MODULES)).replace("__DENIED__", repr(DENIED_MODULES))
              .replace("__NOBODY__", str(NOBODY)))


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None  # None only if the process could not be reaped; negative: killed by that signal
    timed_out: bool  # the wall-clock timeout fired, or the CPU-seconds limit killed it (SIGXCPU)
    duration_s: float = 0.0
    network_namespace: bool = False  # the child ran in its own network namespace

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.cache
def _network_prefix() -> tuple[str, ...]:
    """The command prefix that gives the child an empty network namespace on this host, or () if none works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "--net", "--"), (unshare, "--user", "--map-root-user", "--net", "--")):
        try:
            r = subprocess.run([*prefix, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=10, env={}, close_fds=True)
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0:
            return prefix
    return ()


def network_namespace_available() -> bool:
    return bool(_network_prefix())


def _read(f, limit: int) -> str:
    # Read through the descriptor we opened, never by path: the child owns the directory and could have replaced
    # the file by a symlink to something only the parent may read.
    f.seek(0)
    return f.read(limit).decode("utf-8", errors="replace")


def _wait(proc: subprocess.Popen, timeout_s: float) -> None:
    """proc.wait(timeout) without its sleep-polling (which adds up to ~50 ms to a 20 ms run): block on a pidfd."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        proc.wait(timeout=timeout_s)
        return
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)
    if not ready:
        raise subprocess.TimeoutExpired(proc.args, timeout_s)
    proc.wait()


def run_python(
    code: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cpu_s: int | None = None,
    memory_mb: int = DEFAULT_MEMORY_MB,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    network_namespace: bool = True,
) -> SandboxResult:
    """Run `code` as a Python program in the sandbox and return its (truncated) stdout/stderr and exit status.

    cpu_s defaults to the wall-clock timeout rounded up plus one second, so a busy loop is normally ended by the
    wall clock and the CPU limit is the backstop. network_namespace=False skips `unshare` (the Python-level
    network guards stay on)."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 64:
        raise ValueError(f"memory_mb must be >= 64 (the interpreter itself needs ~30 MB), got {memory_mb}")
    cpu = int(cpu_s) if cpu_s is not None else int(timeout_s) + 1
    if cpu < 1:
        raise ValueError(f"cpu_s must be >= 1, got {cpu_s}")
    prefix = _network_prefix() if network_namespace else ()
    drop = os.geteuid() == 0 and (not prefix or "--user" not in prefix)
    with tempfile.TemporaryDirectory(prefix="orl_sandbox_") as tmp:
        work = Path(tmp)
        src = work / "main.py"
        src.write_text(code, encoding="utf-8")
        if drop:  # the unprivileged child needs its scratch directory
            os.chown(work, NOBODY, NOBODY)
        cmd = [*prefix, sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP,
               str(src), str(cpu), str(memory_mb * 1024 * 1024), str(FILE_SIZE_LIMIT_BYTES), "1" if drop else "0"]
        t0 = time.monotonic()
        timed_out = False
        with open(work / ".stdout", "w+b") as out, open(work / ".stderr", "w+b") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=work, env={},
                                    close_fds=True, start_new_session=True)
            try:
                _wait(proc, timeout_s)
            except BaseException as e:  # timeout (or the caller interrupted us): kill the whole group, then reap
                timed_out = isinstance(e, subprocess.TimeoutExpired)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the child is not reaped yet, so its pgid cannot be reused
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                if not timed_out:
                    raise
            duration = time.monotonic() - t0
            stdout, stderr = _read(out, max_output_bytes), _read(err, max_output_bytes)
        rc = proc.returncode
        if rc == -signal.SIGXCPU:
            timed_out = True
        return SandboxResult(stdout=stdout, stderr=stderr, returncode=rc, timed_out=timed_out, duration_s=duration,
                             network_namespace=bool(prefix))


def run_many(codes: Sequence[str], *, max_workers: int | None = None, **kwargs) -> list[SandboxResult]:
    """run_python over many programs, each in its own sandboxed process, a few at a time (threads only wait)."""
    codes = list(codes)
    if not codes:
        return []
    workers = max_workers or min(len(codes), os.cpu_count() or 1)
    if workers == 1:
        return [run_python(c, **kwargs) for c in codes]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(functools.partial(run_python, **kwargs), codes))
