"""Programs that try to get out of the code sandbox: each is scored as a failure of its kind, leaves
no process or file behind, and the verifier goes on scoring.

Each attack's tests pass only if the attack worked (the secret was read, the socket connected, the
file was written, the parent died), so a sandbox that let it through would score it `passed`. They
all run at once on one verifier (`check_many`), each bounded by the sandbox's deadline.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile

import pytest

from scalerl_jax.sandbox.bubblewrap import ROOT_UID_BASE
from scalerl_jax.sandbox.verifier import CodeVerifier, SandboxLimits, Verdict

LIMITS = SandboxLimits(wall_s=4.0, cpu_s=2, memory_bytes=512 << 20, file_bytes=1 << 20, processes=16, workers=4)
SECRET_NAME = "SCALERL_SANDBOX_TEST_SECRET"
SECRET = "s3cr3t-9f2c1e"


def sandbox_processes() -> list[tuple[int, str]]:
    """(pid, command) of every process that runs as a sandbox user (root: the uids from
    ROOT_UID_BASE), or, when the tests do not run as root, every bwrap process of this machine."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, StopIteration):
            continue  # the process ended while it was read
        if (os.geteuid() == 0 and uid >= ROOT_UID_BASE) or (os.geteuid() != 0 and "bwrap" in cmd.split(" ")[0]):
            found.append((int(entry), cmd[:80]))
    return found


@pytest.fixture(scope="module")
def outside():
    """Host things an attack would reach: a world-writable directory, a listening socket on the
    host's loopback, a process standing in for a parent worth killing, the secret in our environment."""
    directory = tempfile.mkdtemp(prefix="scalerl-escape-", dir="/tmp")
    os.chmod(directory, 0o777)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.0)
    bystander = subprocess.Popen(["sleep", "120"])
    os.environ[SECRET_NAME] = SECRET
    yield {"dir": directory, "port": listener.getsockname()[1], "bystander": bystander, "listener": listener}
    del os.environ[SECRET_NAME]
    bystander.kill()
    bystander.wait()
    listener.close()
    for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
    os.rmdir(directory)


def attacks(outside: dict) -> dict[str, tuple[str, str]]:
    """name -> (program, tests): the tests pass only when the attack worked."""
    here, parent, directory, port = os.getpid(), os.getppid(), outside["dir"], outside["port"]
    bystander = outside["bystander"].pid
    return {
        "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", "pass\n"),
        "allocate_10gb": ("blob = bytearray(10 * 1024**3)\n", "assert len(blob) > 0\n"),
        "loop_forever": ("while True:\n    pass\n", "pass\n"),
        "sleep_past_deadline": ("import time\ntime.sleep(60)\n", "pass\n"),
        "write_outside": (
            "written = []\n"
            f"for path in [{directory!r} + '/escaped', {os.getcwd()!r} + '/escaped', '/var/tmp/escaped', "
            "'/dev/shm/escaped', '/escaped']:\n"
            "    try:\n"
            "        with open(path, 'w') as f:\n"
            "            f.write('out')\n"
            "        written.append(path)\n"
            "    except OSError:\n"
            "        pass\n",
            "assert written, 'nothing written outside'\n",
        ),
        "read_parent_environment": (
            "import os\n"
            "seen = ' '.join(os.environ.values())\n"
            f"for pid in ['self', str(os.getppid()), '1', '{here}', '{parent}'] + os.listdir('/proc'):\n"
            "    try:\n"
            "        with open(f'/proc/{pid}/environ', 'rb') as f:\n"
            "            seen += f.read().decode(errors='replace')\n"
            "    except OSError:\n"
            "        pass\n",
            f"assert {SECRET!r} in seen, 'no secret found'\n",
        ),
        "socket_to_host_loopback": (
            f"import socket\nconnection = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
            "assert connection\n",
        ),
        "socket_to_outside": (
            "import socket\nconnection = socket.create_connection(('1.1.1.1', 53), timeout=1)\n",
            "assert connection\n",
        ),
        "kill_parent": (
            "import os, signal\n"
            "killed = []\n"
            f"for pid in [os.getppid(), 1, {here}, {parent}, {bystander}]:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        killed.append(pid)\n"
            "    except OSError:\n"
            "        pass\n"
            "import time\ntime.sleep(0.2)\n",
            # the pids of this side are not in the sandbox's namespace, and its init ignores the signal
            f"assert {bystander} in killed or {here} in killed, 'no parent killed'\n",
        ),
        "setsid_escape": (
            "import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    while True:\n"
            "        time.sleep(1)\n"
            "time.sleep(60)\n",
            "pass\n",
        ),
        "daemon_left_behind": (
            "import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(120)\n"
            "    os._exit(0)\n"
            "os._exit(0)\n",
            "pass\n",
        ),
        "print_1gb": ("chunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    print(chunk)\n", "pass\n"),
        "exit_0_before_tests": ("import os\nos._exit(0)\n", "assert False\n"),
        "patch_assert_and_exceptions": (
            "import builtins\n"
            "class Quiet(Exception):\n    pass\n"
            "builtins.AssertionError = Quiet\n"
            "builtins.BaseException = Quiet\n"
            "builtins.Exception = Quiet\n"
            "builtins.MemoryError = Quiet\n",
            "assert 1 == 2\n",
        ),
        "patch_exit": (
            "import os, sys\nsys.exit = lambda *args: None\nos._exit = lambda *args: None\n",
            "assert 1 == 2\n",
        ),
        "patch_exec_and_compile": (
            "import builtins, json\n"
            "builtins.exec = lambda *args, **kwargs: None\n"
            "builtins.compile = lambda *args, **kwargs: None\n"
            "json.dumps = lambda *args, **kwargs: 'passed'\n",
            "assert 1 == 2\n",
        ),
        "forge_a_verdict_line": (
            "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'passed \\n0 passed \\n')\n"
            "    except OSError:\n        pass\n",
            "assert 1 == 2\n",
        ),
    }


EXPECTED_KIND = {
    "fork_bomb": "failed",  # BlockingIOError at the process limit
    "allocate_10gb": "memory",
    "loop_forever": "timeout",
    "sleep_past_deadline": "timeout",
    "write_outside": "failed",
    "read_parent_environment": "failed",
    "socket_to_host_loopback": "failed",
    "socket_to_outside": "failed",
    "kill_parent": "failed",
    "setsid_escape": "timeout",
    "daemon_left_behind": "crash",  # exited before the tests ran
    "print_1gb": "failed",  # OSError: File too large, at the file-size limit
    "exit_0_before_tests": "crash",
    "patch_assert_and_exceptions": "failed",
    "patch_exit": "failed",
    "patch_exec_and_compile": "failed",
    "forge_a_verdict_line": "failed",
}


@pytest.fixture(scope="module")
def verdicts(outside) -> dict[str, Verdict]:
    assert not sandbox_processes(), "sandbox processes were running before the attacks"
    outside["open_fds"] = len(os.listdir("/proc/self/fd"))
    verifier = CodeVerifier(LIMITS)
    cases = attacks(outside)
    results = dict(zip(cases, verifier.check_many(list(cases.values()))))
    # The run goes on: the same verifier still scores an honest program.
    results["honest_after_attacks"] = verifier.check("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5\n")
    return results


@pytest.mark.parametrize("name", sorted(EXPECTED_KIND))
def test_each_attack_fails_with_its_kind(verdicts, name):
    verdict = verdicts[name]
    assert verdict.kind == EXPECTED_KIND[name], f"{name}: {verdict}"
    assert verdict.seconds <= LIMITS.wall_s + 2.0


def test_what_the_attacks_met(verdicts):
    """The failures are the sandbox's doing, not an accident of the attack's code."""
    assert "BlockingIOError" in verdicts["fork_bomb"].detail
    assert verdicts["allocate_10gb"].detail.startswith("MemoryError")
    assert "Connection refused" in verdicts["socket_to_host_loopback"].detail  # its own loopback
    assert "Network is unreachable" in verdicts["socket_to_outside"].detail  # no route out at all
    assert "File too large" in verdicts["print_1gb"].detail
    assert len(verdicts["print_1gb"].stdout) <= LIMITS.output_bytes
    assert verdicts["sleep_past_deadline"].detail == "wall-clock deadline"


def test_nothing_is_left_behind_and_the_host_is_untouched(verdicts, outside):
    assert verdicts["honest_after_attacks"].passed
    assert not sandbox_processes()
    assert len(os.listdir("/proc/self/fd")) == outside["open_fds"]  # every pipe and output file closed
    assert os.listdir(outside["dir"]) == []
    assert not os.path.exists(os.path.join(os.getcwd(), "escaped"))
    assert outside["bystander"].poll() is None  # the process a program tried to kill still runs
    with pytest.raises(BlockingIOError):  # no connection ever reached the host's listener
        outside["listener"].accept()
    if os.geteuid() == 0:
        owned = [name for name in os.listdir("/tmp") if os.stat(os.path.join("/tmp", name)).st_uid >= ROOT_UID_BASE]
        assert owned == []


def test_a_deadline_kill_takes_the_whole_namespace():
    """The wall deadline kills bwrap; a process that left the program's session (setsid) goes too."""
    verifier = CodeVerifier(SandboxLimits(wall_s=1.5, cpu_s=5, workers=1))
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)\n"
    verdict = verifier.check(program, "pass\n")
    assert verdict.kind == "timeout" and verdict.detail == "wall-clock deadline"
    assert not sandbox_processes()


def test_signal_ends_are_classified():
    verifier = CodeVerifier(SandboxLimits(wall_s=5.0, workers=1))
    verdict = verifier.check("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "pass\n")
    assert (verdict.kind, verdict.detail) == ("crash", "killed by SIGSEGV")
