"""The code that runs inside the code sandbox, around the untrusted program.

The sandbox (`scalerl_jax.sandbox.bubblewrap`) starts `python -I -S -B -u -c <this file's text>` as
PID 1 of its namespace, with one JSON request on stdin: `program` and `tests` (Python source),
`nonce` (hex), `report_fd` (an inherited pipe) and `limits` (`address_space`, `cpu_s`,
`file_size`, `open_files`, `processes`: bytes, seconds, counts). Two processes share the work:

The supervisor (PID 1) reads the request, points stdin at /dev/null and forks the runner; it runs
no untrusted code. When the runner has ended it writes `<nonce> exit <status>` or
`<nonce> signal <NAME>` to `report_fd` and exits, and with it (PID 1) every process the program
left in the namespace is killed by the kernel. PID 1 also ignores signals it has no handler for,
which is why the program runs in a child: there its resource-limit signals act (SIGXCPU ends it).

The runner lowers its own resource limits to `limits`, compiles the program (a SyntaxError is
`unparsable`), runs the program and then the tests in one fresh namespace, and writes one verdict
`<nonce> <kind> <detail>` to `report_fd`, kind one of:
  passed       the program and every test ran without an exception
  failed       an exception (an `assert` of the tests, a SystemExit, anything else) stopped them
  memory       a MemoryError stopped them (the address-space limit)
  unparsable   the program does not compile
then leaves with `os._exit`. A runner that ends without a verdict (`os._exit(0)` in the program, a
signal, a resource limit) has only the supervisor's line, and the caller scores it by that.

The program runs in the runner's process, so it can replace anything reachable by name. The runner
holds what it needs after the program (the writer, `os._exit`, the exception types, `exec`) in local
variables bound before the program starts, formats the line with methods of `str` and `bytes`
(which no program can replace), and writes only from its own process (a fork of the program never
reports). Two limits stay: a program that walks the interpreter's frames can find the nonce, and a
function that returns an object whose `__eq__` is always true passes an `==` test.
"""

import json
import os
import resource
import signal
import sys
from typing import NoReturn

DETAIL_BYTES = 400


def lower_limits(limits: dict) -> None:
    """Sets this process's soft and hard resource limits (children inherit them); the CPU limit's
    hard value is one second above its soft one, so SIGXCPU ends the process first."""
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    for name, key in (
        ("RLIMIT_AS", "address_space"),
        ("RLIMIT_FSIZE", "file_size"),
        ("RLIMIT_NOFILE", "open_files"),
        ("RLIMIT_NPROC", "processes"),
    ):
        value = int(limits[key])
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_untrusted(request: dict, nonce: str, report_fd: int) -> NoReturn:
    """The runner (the module docstring): program, then tests, then one verdict line."""
    write, exit_now, getpid, run_code, compile_source = os.write, os._exit, os.getpid, exec, compile
    base_error, memory_error, syntax_error, text_type = BaseException, MemoryError, SyntaxError, str
    runner = getpid()

    def report(kind: str, detail: str) -> NoReturn:
        if getpid() == runner:
            line = (nonce + " " + kind + " " + detail).encode("utf-8", "replace")[:DETAIL_BYTES]
            write(report_fd, line.replace(b"\n", b" ") + b"\n")
        exit_now(0)

    def describe(error: BaseException) -> str:
        try:
            return type(error).__name__ + ": " + text_type(error)
        except base_error:  # an exception whose __str__ itself fails
            return type(error).__name__

    lower_limits(request["limits"])
    try:
        program = compile_source(request["program"], "<program>", "exec")
    except (syntax_error, ValueError) as error:  # ValueError: a NUL byte in the source
        report("unparsable", describe(error))
    namespace: dict = {}
    try:
        tests = compile_source(request["tests"], "<tests>", "exec")  # the caller checked that they compile
        run_code(program, namespace)
        run_code(tests, namespace)
    except memory_error as error:
        report("memory", describe(error))
    except base_error as error:
        report("failed", describe(error))
    report("passed", "")


def main() -> NoReturn:
    """The supervisor (the module docstring)."""
    request = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    nonce, report_fd = str(request["nonce"]), int(request["report_fd"])
    runner = os.fork()
    if runner == 0:
        run_untrusted(request, nonce, report_fd)
    _, status = os.waitpid(runner, 0)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        end = "signal " + (signal.Signals(number).name if number in set(signal.Signals) else str(number))
    else:
        end = "exit " + str(os.WEXITSTATUS(status))
    os.write(report_fd, (nonce + " " + end + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
