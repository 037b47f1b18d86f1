"""One launch attempt: start a group of processes together, stream their output, stop them together.

Every process starts in its own session, so a signal to its process group also reaches what it
spawned (data-loader workers, compiler daemons). The attempt ends when every process has exited,
or is cut short — SIGTERM (and SIGCONT, which wakes a stopped process to act on it) to each
group, SIGKILL to whatever is left ``grace_s`` later — when:
  - no process printed anything for ``idle_timeout_s`` (the idle watchdog, exit 124): a hung
    collective keeps every rank alive by ``kill -0`` but quiets its output. Until the first
    ``step=N`` line the bound is ``startup_timeout_s`` when given: start-up (imports, the
    rendezvous, a checkpoint load) is quiet far longer than a step. Before they are
    stopped, ``on_idle_timeout`` (the hang forensics) may look at them, for at most
    ``on_idle_timeout_bound_s``; the suspects it names go into the result;
  - one process failed while others still run, since the others would wait on the dead rank
    forever (exit code: the first failure's; a death by signal N reads as 128 + N). Under
    ``goodput launch --in-process`` (``in_process``) the others are not stopped: the attempt
    ends with ``continues``, and ``Attempt.run`` again recovers them in process with a warm
    spare in the dead rank's place (``launch.inprocess``), or stops them all when it cannot.
    A hang whose forensics name one suspect rank is recovered so too, that rank killed first;
  - the launcher itself got SIGINT or SIGTERM (exit 130 or 143), which it forwards. A second
    signal skips the grace period.
Groups are cleaned up the same way after a normal end, so no stray process outlives its attempt.

Output is bytes, line by line: undecodable bytes pass through untouched, a last line without a
newline still comes out (with one added, so prefixed streams stay line-aligned). Lines that start
with ``step=N`` are the progress signal. Deciding whether to retry is ``retry``'s job; building
command lines is the launchers'. Standard library only: this runs on login nodes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from goodput.errors import ExitCode, GoodputError
from goodput.launch.history import Evidence
from goodput.launch.inprocess import Fallback, InProcess, Recovered

# A step number past 15 digits is no trainer's (and past 2**53 no record's): not a step line.
STEP_LINE = re.compile(rb"step=(\d{1,15})(?!\d)")
NUM_TAIL_LINES = 50
POLL_S = 0.05
READ_BYTES = 1 << 16
MAX_LINE_BYTES = 1 << 20  # a longer run without a newline comes out in pieces
AFTER_KILL_WAIT_S = 1.0  # how long to wait on a process or reader after SIGKILL


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    argv: list[str]
    env: dict[str, str]  # the whole environment; nothing is inherited
    label: str  # output prefix, usually the rank


@dataclass(frozen=True, slots=True)
class AttemptResult:
    exit_code: int
    duration_s: float
    timed_out: bool  # the idle watchdog fired
    first_failure_label: str | None
    steps_seen: int  # ``step=`` lines from all processes
    last_step: int | None  # the highest step seen
    first_step: int | None  # the lowest step seen (a resumed run starts past 1)
    tail_lines: list[bytes]  # the last lines as printed (prefixed), without newlines
    launcher_signal: int | None = None  # SIGINT/SIGTERM the launcher itself got, if any
    first_step_after_s: float | None = None  # when the first ``step=`` line came, from the start
    suspects: tuple[Evidence, ...] = ()  # the hang forensics' suspects, when the watchdog fired
    # A rank died and the processes run on, to be recovered in process by the next attempt.
    continues: bool = False
    recovery: Recovered | Fallback | None = None  # how this attempt began, if in process


# Called when the idle watchdog fires, with the attempt's notice (a line to stderr and the log):
# the hang suspects. It runs in a thread of its own, and the attempt waits for it only so long.
IdleHook = Callable[[Callable[[str], None]], tuple[Evidence, ...]]
IDLE_HOOK_BOUND_S = 120.0


def run_attempt(processes: list[ProcessSpec], **options: Any) -> AttemptResult:
    """``open_attempt(processes, **options).run()``: start the processes, run them to the end."""
    return open_attempt(processes, **options).run()


def open_attempt(
    processes: list[ProcessSpec],
    *,
    idle_timeout_s: float | None,
    startup_timeout_s: float | None = None,
    grace_s: float = 10.0,
    log_path: Path | None = None,
    prefix: bool = True,
    out: BinaryIO | None = None,
    on_line: Callable[[bytes], None] | None = None,
    on_idle_timeout: IdleHook | None = None,
    on_idle_timeout_bound_s: float = IDLE_HOOK_BOUND_S,
    in_process: InProcess | None = None,
) -> Attempt:
    """Start ``processes`` (and ``in_process``'s warm spares); ``Attempt.run`` runs them until the
    attempt ends. ``out`` defaults to this process's stdout (as bytes). ``on_line`` sees every
    output line (without prefix or newline), one at a time. ``on_idle_timeout``: see the module
    docstring. ``in_process``: a rank's death ends the attempt with ``continues`` set, its
    processes left running: ``run`` again recovers them in process (``launch.inprocess``) and
    runs the next attempt."""
    if not processes:
        raise ValueError("an attempt needs at least one process")
    settings = _Settings(
        idle_timeout_s, startup_timeout_s, grace_s, on_idle_timeout, on_idle_timeout_bound_s
    )
    # Owned by the attempt, closed by ``stop``: an in-process recovery carries it on.
    log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
    attempt = Attempt(out if out is not None else sys.stdout.buffer, log, prefix, on_line)
    attempt.settings, attempt.in_process = settings, in_process
    try:
        attempt.start(processes)
        if in_process is not None:
            for _ in range(in_process.spares_warm):
                attempt.start_spare(processes[0])
    except BaseException:
        attempt.stop(0.0, [])
        raise
    return attempt


@dataclass(frozen=True, slots=True)
class _Settings:
    idle_timeout_s: float | None
    startup_timeout_s: float | None
    grace_s: float
    on_idle_timeout: IdleHook | None
    on_idle_timeout_bound_s: float


class Attempt:
    """The running processes, one reader thread each, and what their output said so far."""

    settings: _Settings
    in_process: InProcess | None = None

    def __init__(
        self,
        out: BinaryIO,
        log: BinaryIO | None,
        prefix: bool,
        on_line: Callable[[bytes], None] | None,
    ):
        self.sinks: list[BinaryIO] = [out] if log is None else [out, log]
        self.log = log
        self.prefix = prefix
        self.on_line = on_line
        self.lock = threading.Lock()  # guards the counters, the tail and the sinks
        self.running: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.readers: list[threading.Thread] = []
        self.spare_template: ProcessSpec | None = None  # a rank's, for each new warm spare
        self.death: tuple[int, int, str] | None = None  # (rank, code, label) to recover from
        self._reset()

    def _reset(self) -> None:
        """The counters of one attempt (an in-process recovery starts the next)."""
        with self.lock:
            self.last_output = time.monotonic()
            self.steps_seen = 0
            self.last_step: int | None = None
            self.first_step: int | None = None
            self.first_step_time: float | None = None  # time.monotonic() of the first step line
            self.tail: collections.deque[bytes] = collections.deque(maxlen=NUM_TAIL_LINES)

    def run(self) -> AttemptResult:
        """Wait until the attempt ends (after the in-process recovery it starts with, if any),
        then stop every process unless a rank's death is to be recovered in process."""
        started = time.monotonic()
        settings = self.settings
        suspects: tuple[Evidence, ...] = ()
        recovery: Recovered | Fallback | None = None
        with _caught_stop_signals() as received:
            try:
                if self.death is not None:
                    recovery = self._recover(received)
                if isinstance(recovery, Fallback):
                    exit_code, failed, timed_out = recovery.code, recovery.label, False
                else:
                    exit_code, failed, timed_out = self.wait(
                        settings.idle_timeout_s, settings.startup_timeout_s, received
                    )
                if timed_out and settings.on_idle_timeout is not None:
                    suspects = self.investigate(
                        settings.on_idle_timeout, settings.on_idle_timeout_bound_s, received
                    )
                    if self.in_process is not None and not received:
                        self._stop_hang_suspect(suspects)
            finally:
                if self.death is None:
                    self.stop(settings.grace_s, received)
        duration_s = time.monotonic() - started
        first_step_after_s = None
        if self.first_step_time is not None:
            # A reader left behind by ``stop`` may still see a step; it cannot come after the end.
            first_step_after_s = min(self.first_step_time - started, duration_s)
        return AttemptResult(
            int(exit_code),
            duration_s,
            timed_out,
            failed,
            self.steps_seen,
            self.last_step,
            self.first_step,
            list(self.tail),
            received[0] if received else None,
            first_step_after_s,
            suspects,
            continues=self.death is not None,
            recovery=recovery,
        )

    def _stop_hang_suspect(self, suspects: tuple[Evidence, ...]) -> None:
        """Under ``--in-process``, a hang with one suspect rank: that rank is killed and the
        others recover in process without it (as from its death); more suspects, or none, stop
        every process as without ``--in-process``."""
        assert self.in_process is not None
        ranks = {item.rank for item in suspects if item.rank is not None}
        if len(ranks) != 1 or not 0 <= (rank := ranks.pop()) < len(self.running):
            return
        label, process = self.running[rank]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(AFTER_KILL_WAIT_S)
        if process.poll() is not None:
            self.in_process.abort(len(self.running))
            self.notice(f"launch: hang suspect {label} killed; recovering in process")
            self.death = (rank, ExitCode.IDLE_TIMEOUT, label)

    def _recover(self, received: list[int]) -> Recovered | Fallback:
        """The in-process recovery of ``death``: the spare's process takes the rank's place,
        and a new warm spare starts; or the fallback, said in the log."""
        assert self.death is not None and self.in_process is not None
        rank, code, label = self.death
        self.death = None
        self._reset()
        ranks = [process for _, process in self.running]
        outcome = self.in_process.recover(rank, ranks, self.notice, lambda: bool(received))
        if isinstance(outcome, Fallback):
            self.notice(
                f"launch: in-process recovery failed: {outcome.why}; stopping all processes"
            )
            return dataclasses.replace(outcome, code=code, label=label)
        self.running[rank] = (self.running[rank][0], ranks[rank])
        took = outcome.abort_s + outcome.rendezvous_s
        self.notice(
            f"launch: generation {outcome.generation} up in {took:.2f} s (abort "
            f"{outcome.abort_s:.2f} s, rendezvous {outcome.rendezvous_s:.2f} s)"
        )
        if self.spare_template is not None:
            self.start_spare(self.spare_template)
        return outcome

    def start_spare(self, rank_spec: ProcessSpec) -> None:
        """A warm spare (``in_process.spare_spec``), read like a rank but not waited for."""
        assert self.in_process is not None
        self.spare_template = rank_spec
        spare, env = self.in_process.spare_env(rank_spec.env)
        spec = ProcessSpec(list(rank_spec.argv), env, f"spare{spare}")
        process = start_process(spec, "check the command and that it is installed and executable")
        self.in_process.spares[spare] = process
        self._read_in_thread(process, spec.label)

    def start(self, specs: list[ProcessSpec]) -> None:
        for spec in specs:
            process = start_process(
                spec, "check the command and that it is installed and executable"
            )
            self.running.append((spec.label, process))
            self._read_in_thread(process, spec.label)

    def _read_in_thread(self, process: subprocess.Popen[bytes], label: str) -> None:
        head = f"[{label}] ".encode() if self.prefix else b""
        reader = threading.Thread(
            target=self._read, args=(process, head), name=f"read-{label}", daemon=True
        )
        reader.start()
        self.readers.append(reader)

    def wait(
        self, idle_timeout_s: float | None, startup_timeout_s: float | None, received: list[int]
    ) -> tuple[int, str | None, bool]:
        """Poll until all exit or one must stop the rest: (code, failed label, timed out)."""
        while True:
            starting = startup_timeout_s is not None and self.first_step_time is None
            quiet_s = startup_timeout_s if starting else idle_timeout_s
            alive = [process.poll() is None for _, process in self.running]
            failure = next(
                ((label, p.returncode) for label, p in self.running if p.returncode), None
            )
            if received:
                name = signal.Signals(received[0]).name
                self.notice(f"launch: got {name}; stopping all processes")
                interrupted = received[0] == signal.SIGINT
                return ExitCode.INTERRUPTED if interrupted else ExitCode.TERMINATED, None, False
            if failure is not None:
                label, returncode = failure
                code = 128 - returncode if returncode < 0 else returncode
                if self.in_process is not None and any(alive):
                    rank = next(r for r, (name, _) in enumerate(self.running) if name == label)
                    self.in_process.abort(len(self.running))
                    self.notice(f"launch: process {label} exited {code}; recovering in process")
                    self.death = (rank, code, label)
                    return code, label, False
                if any(alive):
                    self.notice(f"launch: process {label} exited {code}; stopping the others")
                return code, label, False
            if quiet_s is not None and time.monotonic() - self.last_output > quiet_s:
                before = " before the first step" if starting else ""
                self.notice(f"launch: no output for {quiet_s:g} s{before}; stopping all processes")
                return ExitCode.IDLE_TIMEOUT, None, True
            if not any(alive):
                return ExitCode.OK, None, False
            time.sleep(POLL_S)

    def investigate(
        self, hook: IdleHook, bound_s: float, received: list[int]
    ) -> tuple[Evidence, ...]:
        """``hook``'s suspects, or () when it fails, outlives ``bound_s`` or a signal comes: a
        bug or a silent host there must not keep the ranks from being stopped."""
        answer: list[tuple[Evidence, ...]] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                answer.append(hook(self.notice))
            except Exception as error:  # noqa: BLE001 - said below, then the ranks are stopped
                failure.append(error)

        worker = threading.Thread(target=run, name="hang-forensics", daemon=True)
        worker.start()
        deadline = time.monotonic() + bound_s
        num_signals = len(received)
        while worker.is_alive() and time.monotonic() < deadline and len(received) == num_signals:
            worker.join(POLL_S)
        if failure:
            self.notice(f"launch: forensics failed: {type(failure[0]).__name__}: {failure[0]}")
        elif not answer:
            self.notice(f"launch: forensics gave no answer within {bound_s:g} s")
        return answer[0] if answer else ()

    def stop(self, grace_s: float, received: list[int]) -> None:
        """SIGTERM every group, wait up to ``grace_s`` (or a further signal), SIGKILL the rest.

        Groups whose leader already exited are signalled too: what they left behind goes."""
        num_signals = len(received)
        self._signal_groups(signal.SIGTERM)
        # A stopped process (SIGSTOP, a debugger) acts on its SIGTERM only once it runs again;
        # woken, a stopped rank rejoins its peers' collective and they can all save and exit
        # at once instead of waiting out the grace.
        self._signal_groups(signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and len(received) == num_signals:
            if all(p.poll() is not None for p in self._every_process()) and not any(
                reader.is_alive() for reader in self.readers
            ):
                break  # every leader reaped and every output pipe closed
            time.sleep(POLL_S)
        self._signal_groups(signal.SIGKILL)
        # A process stuck in the kernel (a hung file system) outlives SIGKILL, and one that left
        # its group (setsid) with the pipe open would block its reader forever: both are left
        # behind rather than hang the launcher, whose job is to get the next attempt going.
        for process in self._every_process():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(AFTER_KILL_WAIT_S)
        for reader in self.readers:
            reader.join(AFTER_KILL_WAIT_S)
        if self.log is not None:
            with self.lock:
                self.sinks = [sink for sink in self.sinks if sink is not self.log]
            self.log.close()

    def _every_process(self) -> list[subprocess.Popen[bytes]]:
        """The ranks' processes (a spare given a rank among them), and the warm spares'."""
        spares = list(self.in_process.spares.values()) if self.in_process is not None else []
        return [process for _, process in self.running] + spares

    def _signal_groups(self, signum: int) -> None:
        for process in self._every_process():
            # The group id is the leader's pid, which stays reserved while the group has members.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)

    def _read(self, process: subprocess.Popen[bytes], head: bytes) -> None:
        assert process.stdout is not None
        pending = b""
        with process.stdout as stream:
            # os.read returns what is there; any bytes, even a partial line, count as output.
            while chunk := os.read(stream.fileno(), READ_BYTES):
                self.last_output = time.monotonic()
                *lines, pending = (pending + chunk).split(b"\n")
                if len(pending) > MAX_LINE_BYTES:
                    lines.append(pending)
                    pending = b""
                for line in lines:
                    self._emit(head, line)
        if pending:
            self._emit(head, pending)

    def _emit(self, head: bytes, line: bytes) -> None:
        match = STEP_LINE.match(line)
        with self.lock:
            if match is not None:
                self.steps_seen += 1
                step = int(match[1])
                self.last_step = max(step, self.last_step or 0)
                self.first_step = min(step, self.first_step or step)
                if self.first_step_time is None:
                    self.first_step_time = time.monotonic()
            self.tail.append(head + line)
            self._write(head + line + b"\n")
            if self.on_line is not None:
                self.on_line(line)

    def notice(self, text: str) -> None:
        """A line of the launcher's own, to stderr and the log (not to the tail)."""
        print(text, file=sys.stderr, flush=True)
        with self.lock:
            self._write(text.encode() + b"\n", self.sinks[1:])

    def _write(self, data: bytes, sinks: list[BinaryIO] | None = None) -> None:
        for sink in list(self.sinks if sinks is None else sinks):
            try:
                sink.write(data)
                sink.flush()
            except (OSError, ValueError) as error:
                # A closed stdout or a full disk must not stop the reader: the pipe would fill,
                # the process would block on its next print and the watchdog would blame it.
                self.sinks.remove(sink)
                print(f"launch: stopped writing output to {sink}: {error}", file=sys.stderr)


def start_process(spec: ProcessSpec, fix: str) -> subprocess.Popen[bytes]:
    """Start ``spec`` in a session of its own (so its whole group can be signalled), stdout and
    stderr merged into one pipe; a command that cannot start is a usage error saying ``fix``."""
    try:
        return subprocess.Popen(
            spec.argv,
            env=spec.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as error:
        raise cannot_start(spec, error, fix) from None


def cannot_start(spec: ProcessSpec, error: OSError, fix: str) -> GoodputError:
    """The line for ``spec`` that could not start (``error``), saying ``fix``."""
    return GoodputError.usage(
        " ".join(spec.argv[:1]) or f"process {spec.label}",
        f"cannot start: {error.strerror or error}",
        fix,
    )


@contextlib.contextmanager
def _caught_stop_signals() -> Iterator[list[int]]:
    """Record SIGINT/SIGTERM instead of dying of them; only the main thread may install handlers."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    stop_signals = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.getsignal(signum) for signum in stop_signals}
    for signum in stop_signals:
        signal.signal(signum, lambda signum, _frame: received.append(signum))
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
