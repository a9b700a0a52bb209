"""Run untrusted Python (a model's tool call) in a throwaway process that the kernel, not string filtering, confines.

Each call gets a fresh temporary directory (its cwd, HOME and TMPDIR; deleted afterwards), an emptied environment
and an isolated interpreter (`python -I -S`), in a session of its own. Before the code starts, this file, run as
the child's bootstrap in a fresh single-threaded interpreter, confines the child with what the host allows:

- rlimits: CPU seconds, address space, file size, open files, processes, no core files;
- a user + network namespace (no interfaces but a down loopback), when the host lets unprivileged code unshare;
- no capabilities: ambient ones cleared and, for root outside a user namespace, the bounding set emptied (the
  kernel would hand uid 0 every capability in it again at the exec);
- Landlock: writes (create, write, truncate, remove, rename) only beneath the sandbox directory, reads anywhere,
  no ptrace of (or /proc access to) processes outside the sandbox, and (ABI >= 6) no signals to them;
- seccomp: socket() refused (socketpair stays, asyncio needs it), io_uring refused (it creates sockets past the
  filter), setsid/setpgid refused so every process stays in the group that the parent SIGKILLs on timeout and
  after exit; for root, whom the kernel exempts from RLIMIT_NPROC, every new process is refused (threads stay).

The parent (an asyncio coroutine, so the event loop that steps the inference engine keeps running) enforces the
wall-clock limit and the output budget, and kills the whole group in every case. `require_isolation` refuses a
host without seccomp, and one without Landlock unless the caller accepts unconfined writes.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

_MAIN = "main.py"  # the code's file inside the sandbox directory
_MARKER = "SHARDRL_SANDBOX"  # env var naming the sandbox directory: lets tests find any process left behind
_MAX_OPEN_FILES = 64
_PLAIN_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # all the parent's environment a child sees
_CHUNK = 1 << 16


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; every limit applies to the run as a whole (all its processes) unless noted."""

    cpu_seconds: float = 5.0  # RLIMIT_CPU, per process: SIGXCPU at the limit, SIGKILL a second later
    wall_seconds: float = 10.0  # enforced by the parent, which SIGKILLs the process group
    memory_bytes: int = 512 << 20  # RLIMIT_AS, per process: an allocation past it raises MemoryError
    max_output_bytes: int = 64 << 10  # stdout + stderr together; the group is killed at the first byte past it
    max_processes: int = 16  # RLIMIT_NPROC (tasks, threads included); as root new processes are refused instead
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE: a write past it fails with EFBIG


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal
    timed_out: bool
    killed_reason: str | None  # why the run was stopped, as the model should read it ("time limit of 5 s exceeded")
    truncated: bool
    wall_seconds: float

    def render(self) -> str:
        """The text the model sees: what the code printed, then one `Error: ...` line if it was stopped or failed."""
        parts = [text.rstrip("\n") for text in (self.stdout, self.stderr) if text]
        if self.killed_reason is not None:
            parts.append(f"Error: {self.killed_reason}")
        elif self.exit_code != 0 and not self.stderr:
            parts.append(f"Error: exit code {self.exit_code}")
        return "\n".join(parts)

    def metrics(self) -> dict[str, float]:
        return {"timed_out": float(self.timed_out), "truncated": float(self.truncated),
                "exit_code": float(self.exit_code), "wall_seconds": self.wall_seconds}


class SandboxUnavailable(RuntimeError):
    """The host cannot confine the sandbox as asked; one line saying what is missing and what to do."""


@dataclass(frozen=True)
class HostIsolation:
    """What a child on this host managed to do to itself; each `*_error` is None when that mechanism works."""

    userns_error: str | None
    landlock_abi: int  # 0: unavailable
    landlock_error: str | None
    seccomp_error: str | None


@functools.cache
def host_isolation() -> HostIsolation:
    """Probe once, in a throwaway child: namespaces, Landlock and seccomp are irreversible for the process trying."""
    probe = subprocess.run([sys.executable, "-I", "-S", __file__, "--probe"], capture_output=True, text=True,
                           timeout=60, env=_PLAIN_ENV, check=True)
    return HostIsolation(**json.loads(probe.stdout))


def network_isolation() -> str:
    """The mechanisms that keep a sandboxed run off the network here, or "none"."""
    host = host_isolation()
    names = []
    if host.userns_error is None:
        names.append("user+network namespace")
    if host.seccomp_error is None:
        names.append("seccomp socket filter")
    return " and ".join(names) or "none"


def require_isolation(*, allow_host_writes: bool = False) -> None:
    """Refuse, with one line, a host on which the sandbox would run with less isolation than the caller allowed.

    seccomp cannot be waived: without it a child could leave its process group (setsid) and outlive the call, and
    root's children could fork without bound. Network isolation therefore always exists where the sandbox runs
    (seccomp refuses socket()); `allow_network` turns it off rather than accepting its absence.
    """
    host = host_isolation()
    if host.seccomp_error is not None:
        raise SandboxUnavailable(f"no seccomp filter on this host ({host.seccomp_error}): sandboxed code could keep "
                                 f"processes running past the call and reach the network (user namespace: "
                                 f"{host.userns_error or 'works'}); run on a Linux that allows seccomp filters")
    if host.landlock_abi == 0 and not allow_host_writes:
        raise SandboxUnavailable(f"no write isolation available on this host: Landlock: {host.landlock_error} "
                                 f"(needs Linux >= 5.13 with landlock among its LSMs); set allow_host_writes: true "
                                 f"to let sandboxed code write wherever this process's user may")


async def run_python(code: str, limits: SandboxLimits, *, allow_network: bool = False) -> SandboxResult:
    """Run `code` as a script in a new confined process; the event loop keeps running meanwhile."""
    host = host_isolation()
    workdir = tempfile.mkdtemp(prefix="shardrl-sandbox-")
    try:
        with open(os.path.join(workdir, _MAIN), "w", encoding="utf-8") as file:
            file.write(code)
        plan = {"workdir": workdir, "limits": asdict(limits), "landlock_abi": host.landlock_abi,
                "userns": host.userns_error is None and not allow_network, "deny_network": not allow_network,
                "deny_fork": os.geteuid() == 0}
        return await _supervise(workdir, plan, limits)
    finally:
        await asyncio.to_thread(_remove_tree, workdir)  # the code may have left many files: not on the loop


async def _supervise(workdir: str, plan: dict[str, Any], limits: SandboxLimits) -> SandboxResult:
    # Imported here, not at the top: this file is also the child's bootstrap, which `python -I -S` runs where
    # shardrl cannot be imported.
    from shardrl.usercode.procs import kill_group

    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", __file__, json.dumps(plan), cwd=workdir, env=_child_env(workdir),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    capture = _Capture(limits.max_output_bytes, functools.partial(kill_group, proc.pid))
    readers = asyncio.gather(capture.drain(proc.stdout), capture.drain(proc.stderr, into_stderr=True))
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), limits.wall_seconds)
    except TimeoutError:
        timed_out = True
    finally:  # also after a normal exit (and on cancellation): nothing the code started outlives the call
        kill_group(proc.pid)
    exit_code = await proc.wait()
    await readers  # the pipes close once the whole group is dead
    return SandboxResult(capture.stdout.decode("utf-8", "replace"), capture.stderr.decode("utf-8", "replace"),
                         exit_code, timed_out, _killed_reason(limits, exit_code, timed_out, capture.truncated),
                         capture.truncated, time.monotonic() - start)


class _Capture:
    """stdout and stderr under one byte budget; the first byte past it kills the group (the code may print forever)."""

    def __init__(self, budget: int, on_overflow: Callable[[], None]) -> None:
        self.remaining = budget
        self.on_overflow = on_overflow
        self.truncated = False
        self.stdout = bytearray()
        self.stderr = bytearray()

    async def drain(self, stream: asyncio.StreamReader, into_stderr: bool = False) -> None:
        sink = self.stderr if into_stderr else self.stdout
        while chunk := await stream.read(_CHUNK):  # read to EOF so a dying writer never blocks on a full pipe
            kept = chunk[:self.remaining]
            sink += kept
            self.remaining -= len(kept)
            if len(kept) < len(chunk) and not self.truncated:
                self.truncated = True
                self.on_overflow()


def _killed_reason(limits: SandboxLimits, exit_code: int, timed_out: bool, truncated: bool) -> str | None:
    if timed_out:
        return f"time limit of {limits.wall_seconds:g} s exceeded"
    if truncated:
        return f"output limit of {limits.max_output_bytes} bytes exceeded; the rest of the output was cut"
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGKILL unasked: the hard CPU limit, a second later
        return f"CPU time limit of {limits.cpu_seconds:g} s exceeded"
    if exit_code < 0:
        return f"killed by signal {signal.Signals(-exit_code).name}"
    return None


def _child_env(workdir: str) -> dict[str, str]:
    return {**_PLAIN_ENV, "HOME": workdir, "TMPDIR": workdir, _MARKER: workdir}


def _remove_tree(path: str) -> None:
    """rmtree that first makes every directory writable again: a `chmod 000` by the code would stop a plain one."""
    os.chmod(path, 0o700)
    for root, dirs, _ in os.walk(path):  # top-down: each directory is fixed before the walk lists it
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path)


# ---- the child side: runs as `python -I -S sandbox.py PLAN` inside the sandbox, before the code ----

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_PR_CAPBSET_READ, _PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 23, 24, 47, 4
_CLONE_NEWUSER, _CLONE_NEWNET, _CLONE_THREAD = 0x10000000, 0x40000000, 0x00010000
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446  # the same on every arch
_LANDLOCK_WRITE_FILE, _LANDLOCK_TRUNCATE = 1 << 1, 1 << 14
_LANDLOCK_WRITES_V1 = _LANDLOCK_WRITE_FILE | sum(1 << bit for bit in range(4, 13))  # remove_*, make_*
_LANDLOCK_MAKE_DEVICES = 1 << 6 | 1 << 11  # make_char, make_block: refused even inside the sandbox directory
_LANDLOCK_REFER = 1 << 13  # ABI 2: rename/link across directories
_LANDLOCK_SCOPE_ALL = 0b11  # ABI 6: abstract unix sockets, signals
# seccomp: (audit arch, syscall numbers); x86_64's x32 numbers (>= 0x40000000) are refused wholesale
_SYSCALLS = {
    "x86_64": (0xC000003E, {"socket": 41, "setsid": 112, "setpgid": 109, "io_uring_setup": 425, "io_uring_enter": 426,
                            "io_uring_register": 427, "clone": 56, "clone3": 435, "fork": 57, "vfork": 58}),
    "aarch64": (0xC00000B7, {"socket": 198, "setsid": 157, "setpgid": 154, "io_uring_setup": 425,
                             "io_uring_enter": 426, "io_uring_register": 427, "clone": 220, "clone3": 435}),
}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _check(result: int, what: str) -> int:
    if result < 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")
    return result


def _unshare_network() -> None:
    _check(_libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")


def _landlock_abi() -> int:
    return _check(_libc.syscall(_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)),
                  "landlock_create_ruleset")


def _landlock_writes_only_beneath(workdir: str, abi: int) -> None:
    """Writes only beneath `workdir` (and to /dev/null); reads and execution stay unrestricted."""
    writes = _LANDLOCK_WRITES_V1 | (_LANDLOCK_REFER if abi >= 2 else 0) | (_LANDLOCK_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(writes, 0, _LANDLOCK_SCOPE_ALL if abi >= 6 else 0)
    size = ctypes.sizeof(attr) if abi >= 6 else 8  # older kernels refuse the fields they do not know
    ruleset = _check(_libc.syscall(_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                                   ctypes.c_uint32(0)), "landlock_create_ruleset")
    for path, access in ((workdir, writes & ~_LANDLOCK_MAKE_DEVICES),
                         ("/dev/null", writes & (_LANDLOCK_WRITE_FILE | _LANDLOCK_TRUNCATE))):
        rule = _PathBeneathAttr(access, os.open(path, os.O_PATH | os.O_CLOEXEC))
        _check(_libc.syscall(_LANDLOCK_ADD_RULE, ruleset, 1, ctypes.byref(rule), ctypes.c_uint32(0)),
               f"landlock_add_rule({path})")
        os.close(rule.parent_fd)
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(_libc.syscall(_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


def _drop_capabilities() -> None:
    """Leave the code no capability: none ambient, and for uid 0 (which the exec would give the whole bounding set,
    so a root host without user namespaces would hand the code reboot, module loading, mknod, ...) no bounding set.
    In a user namespace the uid is unmapped (not 0), so the exec drops every capability by itself."""
    _check(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    if os.geteuid() == 0:
        with open("/proc/sys/kernel/cap_last_cap") as file:
            last = int(file.read())
        for cap in range(last + 1):
            if _libc.prctl(_PR_CAPBSET_READ, cap, 0, 0, 0) == 1:  # dropping needs CAP_SETPCAP: only what is left
                _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")


def _seccomp_program(deny_network: bool, deny_fork: bool) -> list[tuple[int, int, int, int]]:
    """A classic-BPF filter as (code, jt, jf, k) rows; every jump is to the next row or over one."""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, errno = 0x7FFF0000, 0x00050000
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        raise OSError(f"no seccomp syscall table for {machine}")
    arch, nr = _SYSCALLS[machine]
    rows = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, errno | 1), (ld, 0, 0, 0)]
    if machine == "x86_64":
        rows += [(jge, 0, 1, 0x40000000), (ret, 0, 0, errno | 1)]
    refused = {"setsid": 1, "setpgid": 1, "io_uring_setup": 38, "io_uring_enter": 38, "io_uring_register": 38}
    if deny_network:
        refused["socket"] = 13  # EACCES
    if deny_fork:  # clone3 hides its flags behind a pointer: ENOSYS makes libc fall back to clone
        refused |= {"fork": 1, "vfork": 1, "clone3": 38}
    for name, code in refused.items():
        if name in nr:
            rows += [(jeq, 0, 1, nr[name]), (ret, 0, 0, errno | code)]
    if deny_fork:  # clone: threads (CLONE_THREAD in the flags, args[0]) pass, processes get EPERM
        rows += [(jeq, 0, 4, nr["clone"]), (ld, 0, 0, 16), (jset, 0, 1, _CLONE_THREAD), (ret, 0, 0, allow),
                 (ret, 0, 0, errno | 1)]
    return rows + [(ret, 0, 0, allow)]


def _install_seccomp(deny_network: bool, deny_fork: bool) -> None:
    rows = _seccomp_program(deny_network, deny_fork)
    program = (_SockFilter * len(rows))(*(_SockFilter(*row) for row in rows))
    fprog = _SockFprog(len(rows), program)
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


def _set_rlimits(limits: SandboxLimits) -> None:
    cpu = max(1, math.ceil(limits.cpu_seconds))
    for kind, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, limits.memory_bytes),
                        (resource.RLIMIT_FSIZE, limits.max_file_bytes), (resource.RLIMIT_NOFILE, _MAX_OPEN_FILES),
                        (resource.RLIMIT_NPROC, limits.max_processes), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(kind, value if isinstance(value, tuple) else (value, value))


def _probe() -> dict[str, Any]:
    """Try each mechanism on this (throwaway) process; report what failed and why."""
    found: dict[str, Any] = {"userns_error": None, "landlock_abi": 0, "landlock_error": None, "seccomp_error": None}
    try:
        _unshare_network()
    except OSError as exc:
        found["userns_error"] = str(exc)
    try:
        abi = _landlock_abi()
        _landlock_writes_only_beneath(tempfile.gettempdir(), abi)
        found["landlock_abi"] = abi
    except OSError as exc:
        found["landlock_error"] = str(exc)
    try:
        _install_seccomp(deny_network=True, deny_fork=True)
    except OSError as exc:
        found["seccomp_error"] = str(exc)
    return found


def _boot(plan: dict[str, Any]) -> None:
    """Confine this process as `plan` says, then replace it with the code's interpreter (which inherits it all)."""
    limits = SandboxLimits(**plan["limits"])
    if plan["userns"]:
        _unshare_network()  # before RLIMIT_NPROC: the new namespace then counts only this sandbox's processes
    if plan["landlock_abi"]:
        _landlock_writes_only_beneath(plan["workdir"], plan["landlock_abi"])
    _drop_capabilities()
    _install_seccomp(plan["deny_network"], plan["deny_fork"])
    _set_rlimits(limits)
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", "-u", _MAIN])


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        print(json.dumps(_probe()))
    else:
        _boot(json.loads(sys.argv[1]))
