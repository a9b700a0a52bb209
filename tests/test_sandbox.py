"""The sandbox and the built-in tools, against the real kernel: each confinement is tried by code that breaks it.

A sandbox test skips only where the tool itself refuses to run (`require_isolation` names what the host lacks);
everywhere else a mechanism that does not hold fails its test. Where the host has user namespaces, each sandbox
test also runs without them, as on a host (a container, say) that refuses them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import tempfile
from pathlib import Path

import pytest

from shardrl.agents import sandbox
from shardrl.agents.builtin_tools import CalculatorTool, PythonTool
from shardrl.agents.sandbox import (HostIsolation, SandboxLimits, SandboxResult, SandboxUnavailable,
                                    network_isolation, require_isolation, run_python)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["host", "no user namespace"])
def isolated(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        require_isolation()
    except SandboxUnavailable as exc:
        pytest.skip(f"the sandbox refuses to run on this host: {exc}")
    if request.param == "no user namespace":
        host = sandbox.host_isolation()
        if host.userns_error is not None:
            pytest.skip("this host has no user namespace: the `host` case is this case")
        without = dataclasses.replace(host, userns_error="turned off by the test")
        monkeypatch.setattr(sandbox, "host_isolation", lambda: without)


def _run(code: str, **limits: float) -> SandboxResult:
    return asyncio.run(run_python(code, SandboxLimits(**limits)))


def _sandbox_processes() -> list[int]:
    """Live processes a sandbox started: its marker in their environment, or a sandbox directory as their cwd."""
    sandbox_dirs = os.path.join(tempfile.gettempdir(), "shardrl-sandbox-")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # exited meanwhile, or a zombie (no memory, no cwd): not running
            continue
        if f"{sandbox._MARKER}=".encode() in environ or cwd.startswith(sandbox_dirs):
            found.append(int(pid))
    return found


def test_normal_code_returns_its_output(isolated: None) -> None:
    result = _run("import sys\nprint(sum(range(10)))\nprint('warn', file=sys.stderr)")
    assert (result.stdout, result.stderr, result.exit_code, result.killed_reason) == ("45\n", "warn\n", 0, None)
    assert result.render() == "45\nwarn"
    failed = _run("raise ValueError('bad input')")
    assert failed.exit_code == 1 and "ValueError: bad input" in failed.render()
    assert _run("import sys; sys.exit(3)").render() == "Error: exit code 3"


def test_code_holds_no_capabilities(isolated: None) -> None:
    result = _run("for line in open('/proc/self/status'):\n    if line.startswith(('CapPrm', 'CapEff', 'CapBnd', "
                  "'CapAmb')):\n        print(line.split()[0], int(line.split()[1], 16))")
    sets = dict(line.split() for line in result.stdout.splitlines())
    assert sets["CapPrm:"] == sets["CapEff:"] == sets["CapAmb:"] == "0", result.render()
    if os.geteuid() == 0 and sandbox.host_isolation().userns_error is not None:
        assert sets["CapBnd:"] == "0"  # uid 0 would get the bounding set back at any exec


def test_infinite_loop_is_stopped_by_the_cpu_limit(isolated: None) -> None:
    result = _run("while True:\n    pass", cpu_seconds=1, wall_seconds=20)
    assert not result.timed_out and result.killed_reason == "CPU time limit of 1 s exceeded"
    assert result.render() == "Error: CPU time limit of 1 s exceeded"


def test_sleeping_code_is_stopped_by_the_wall_clock(isolated: None) -> None:
    result = _run("import time\nprint('started')\ntime.sleep(60)", wall_seconds=1)
    assert result.timed_out and result.exit_code == -9 and result.wall_seconds < 5
    assert result.render() == "started\nError: time limit of 1 s exceeded"  # printed output survives the kill


def test_memory_bomb_is_stopped(isolated: None) -> None:
    result = _run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))", memory_bytes=256 << 20)
    assert result.exit_code == 1 and not result.timed_out
    assert result.stderr.rstrip().endswith("MemoryError")


def test_fork_bomb_is_bounded_and_nothing_outlives_the_call(isolated: None) -> None:
    code = """
import os, time
forked = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        print("refused after", forked, flush=True)
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    forked += 1
time.sleep(60)
"""
    assert _sandbox_processes() == []

    async def run_and_look() -> tuple[SandboxResult, list[int]]:
        call = asyncio.create_task(run_python(code, SandboxLimits(max_processes=8, wall_seconds=2)))
        await asyncio.sleep(1)
        running = _sandbox_processes()  # mid-run: the scan does see the sandbox's processes
        return await call, running

    result, running = asyncio.run(run_and_look())
    assert result.timed_out and "refused after" in result.stdout, result.render()
    forked = int(result.stdout.split("refused after")[1])
    # 7 in a user namespace; 0 as root (the kernel exempts root from RLIMIT_NPROC: forks are refused) or when
    # this user's other processes already use up the limit
    assert forked < 8
    assert len(running) == forked + 1
    assert _sandbox_processes() == []


def test_network_is_unreachable(isolated: None, tmp_path: Path) -> None:
    assert network_isolation() != "none"
    with socket.socket() as tcp, socket.socket(socket.AF_UNIX) as unix:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        tcp.setblocking(False)
        unix.bind(str(tmp_path / "listener.sock"))
        unix.listen()
        unix.setblocking(False)
        code = f"""
import socket
for family, address in ((socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]})),
                        (socket.AF_UNIX, {str(tmp_path / "listener.sock")!r})):
    try:
        socket.socket(family).connect(address)
        print("connected", family)
    except OSError as exc:
        print("refused", family, exc)
"""
        result = _run(code)
        assert result.stdout.count("refused") == 2 and "connected" not in result.stdout, result.render()
        for listener in (tcp, unix):
            with pytest.raises(BlockingIOError):  # no connection ever reached the listeners
                listener.accept()


def test_allow_network_lets_the_code_connect(isolated: None) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {listener.getsockname()[1]})).close()"
        result = asyncio.run(run_python(code, SandboxLimits(), allow_network=True))
        assert result.exit_code == 0, result.render()
        listener.accept()[0].close()


def test_writes_outside_the_sandbox_are_refused(isolated: None, tmp_path: Path) -> None:
    kept = tmp_path / "kept.txt"
    kept.write_text("mine")
    code = f"""
import os, pathlib, tempfile
for attempt in (lambda: open({str(tmp_path / 'escaped.txt')!r}, "w"), lambda: os.mkdir({str(tmp_path / 'd')!r}),
                lambda: os.remove({str(kept)!r}), lambda: open({str(kept)!r}, "a"),
                lambda: os.rename({str(kept)!r}, "stolen.txt")):
    try:
        attempt()
        print("wrote outside")
    except OSError as exc:
        print("refused", exc.errno)
pathlib.Path("inside.txt").write_text("ok")
with tempfile.NamedTemporaryFile() as scratch:
    print("home", os.environ["HOME"] == os.getcwd(), "tmp", scratch.name.startswith(os.getcwd()))
print(os.getcwd())
"""
    result = _run(code)
    assert result.stdout.count("refused") == 5 and "wrote outside" not in result.stdout, result.render()
    assert "home True tmp True" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"] and kept.read_text() == "mine"
    assert not Path(result.stdout.splitlines()[-1]).exists()  # the sandbox directory is gone


def test_huge_output_is_truncated(isolated: None) -> None:
    result = _run("import sys\nwhile True:\n    sys.stdout.write('x' * 1000)", max_output_bytes=10_000)
    assert result.truncated and len(result.stdout) == 10_000 and set(result.stdout) == {"x"}
    assert result.wall_seconds < 5 and result.render().endswith("Error: output limit of 10000 bytes exceeded; "
                                                                "the rest of the output was cut")


def test_concurrent_calls_never_exceed_max_concurrency(isolated: None) -> None:
    tool = PythonTool({"type": "native", "max_concurrency": 2})
    code = "import time\nprint(time.time())\ntime.sleep(0.3)\nprint(time.time())"

    async def calls() -> list[str]:
        answers = await asyncio.gather(*(tool.execute("i", {"code": code}) for _ in range(6)))
        return [response.text for response, _, _ in answers]

    spans = [tuple(map(float, text.split())) for text in asyncio.run(calls())]
    most = max(sum(start <= moment < end for start, end in spans) for moment, _ in spans)
    assert most == 2, spans


def test_event_loop_keeps_running_while_code_runs(isolated: None) -> None:
    async def ticks_during_call() -> tuple[int, SandboxResult]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        result = await run_python("import time\ntime.sleep(1)\nprint('done')", SandboxLimits())
        ticker.cancel()
        return ticks, result

    ticks, result = asyncio.run(ticks_during_call())
    assert result.stdout == "done\n" and ticks >= 50


def test_tool_refuses_a_host_without_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    no_seccomp = HostIsolation(userns_error="EPERM", landlock_abi=7, landlock_error=None, seccomp_error="EINVAL")
    monkeypatch.setattr(sandbox, "host_isolation", lambda: no_seccomp)
    with pytest.raises(SandboxUnavailable, match=r"^no seccomp filter on this host \(EINVAL\): "):
        PythonTool({"allow_network": True, "allow_host_writes": True})
    no_landlock = HostIsolation(userns_error="EPERM", landlock_abi=0, landlock_error="ENOSYS", seccomp_error=None)
    monkeypatch.setattr(sandbox, "host_isolation", lambda: no_landlock)
    assert network_isolation() == "seccomp socket filter"
    with pytest.raises(SandboxUnavailable, match="^no write isolation available on this host: Landlock: ENOSYS"):
        PythonTool({})
    assert PythonTool({"allow_host_writes": True}).name == "code_interpreter"


def test_python_tool_schema_config_and_bad_calls(isolated: None) -> None:
    tool = PythonTool({"type": "native", "wall_seconds": 3})
    schema = tool.tool_schema.model_dump()
    assert schema["function"]["name"] == "code_interpreter"
    assert schema["function"]["parameters"] == {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "description": "The Python code to run; print() the values you want to see."}}}
    response, reward, metrics = asyncio.run(tool.execute("i", {"code": "print(6 * 7)"}))
    assert (response.text, reward, metrics["exit_code"], metrics["timed_out"]) == ("42", 0.0, 0.0, 0.0)
    response, _, metrics = asyncio.run(tool.execute("i", {"source": "print(1)"}))
    assert response.text.startswith("Error: `code` must be") and metrics == {"invalid_call": 1.0}
    with pytest.raises(ValueError, match="^PythonTool config: unknown key 'timeout_s'"):
        PythonTool({"timeout_s": 3})
    with pytest.raises(ValueError, match="^PythonTool config: memory_mb must be a positive int, got 0.5"):
        PythonTool({"memory_mb": 0.5})


@pytest.mark.parametrize("expression, answer", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 % 3", "2"), ("2 ** 10", "1024"),
    ("-2 ** 2", "-4"), ("-(3 - 5)", "2"), ("0.1 + 0.2", "0.30000000000000004"), ("2 ** 0.5", "1.4142135623730951"),
])
def test_calculator_values(expression: str, answer: str) -> None:
    response, reward, metrics = asyncio.run(CalculatorTool({"type": "native"}).execute("i", {"expression": expression}))
    assert (response.text, reward, metrics) == (answer, 0.0, {"error": 0.0})


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('true')", "unsupported Call"), ("x + 1", "unsupported Name"),
    ("(1).real", "unsupported Attribute"), ("True + 1", "unsupported Constant"), ("3 << 2", "unsupported BinOp"),
    ("9 ** 9 ** 9", "result too large"), ("(10 ** 1000) * (10 ** 1000)", "result too large"),
    ("1e308 * 10", "not a finite number"), ("1 / 0", "division by zero"), ("(-8) ** (1 / 3)", "complex result"),
    ("1 +", "not an arithmetic expression"), ("-" * 1500 + "1", "nested too deeply"),
])
def test_calculator_refusals(expression: str, error: str) -> None:
    response, _, metrics = asyncio.run(CalculatorTool({}).execute("i", {"expression": expression}))
    assert response.text.startswith("Error: ") and error in response.text and metrics == {"error": 1.0}


def test_calculator_schema_and_config() -> None:
    tool = CalculatorTool({})
    assert tool.name == "calculator" and tool.tool_schema.function.parameters.required == ["expression"]
    response, _, _ = asyncio.run(tool.execute("i", {"expr": "1"}))
    assert response.text == "Error: `expression` must be a string, got None"
    with pytest.raises(ValueError, match="^CalculatorTool config: unknown key 'precision'"):
        CalculatorTool({"precision": 3})

