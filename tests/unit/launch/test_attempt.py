"""run_attempt against real child processes that really print, crash, hang and ignore signals."""

from __future__ import annotations

import io
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from goodput.errors import GoodputError
from goodput.launch.attempt import ProcessSpec, run_attempt

IDLE_S = 1.0
GRACE_S = 1.0
SLACK_S = 1.5  # start-up and polling on a loaded machine


def child(tmp_path: Path, body: str, label: str = "0") -> ProcessSpec:
    script = tmp_path / f"child_{label}.py"
    script.write_text(textwrap.dedent(body))
    return ProcessSpec([sys.executable, "-u", str(script)], dict(os.environ), label)


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie no one reaped yet (our PID 1 may not) counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def pids_of(tmp_path: Path, timeout_s: float = 10.0) -> list[int]:
    """The pids a child wrote to ``pids`` once it is ready (its script's own, then others)."""
    ready = tmp_path / "pids"
    deadline = time.monotonic() + timeout_s
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return [int(word) for word in ready.read_text().split()]


def eventually_dead(pids: list[int], timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not any(alive(pid) for pid in pids)


# Prints, then hangs with a grandchild; says it is ready by writing both pids to "pids".
HANG_WITH_GRANDCHILD = """
    import os, pathlib, subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("started")
    ready = pathlib.Path(__file__).with_name("pids")
    ready.with_suffix(".tmp").write_text(f"{os.getpid()} {grandchild.pid}")
    ready.with_suffix(".tmp").rename(ready)
    time.sleep(60)
"""

CRASH_WHEN_READY = """
    import pathlib, time
    while not pathlib.Path(__file__).with_name("pids").exists():
        time.sleep(0.01)
    raise SystemExit(3)
"""


def test_output_is_prefixed_logged_and_steps_counted(tmp_path):
    spec = child(
        tmp_path, "for step in (1, 2, 3):\n    print(f'step={step} loss=1.0')\nprint('bye')"
    )
    out, log = io.BytesIO(), tmp_path / "attempt.log"
    result = run_attempt([spec], idle_timeout_s=10, grace_s=GRACE_S, log_path=log, out=out)
    expected = b"[0] step=1 loss=1.0\n[0] step=2 loss=1.0\n[0] step=3 loss=1.0\n[0] bye\n"
    assert out.getvalue() == expected
    assert log.read_bytes() == expected
    assert (result.exit_code, result.timed_out, result.first_failure_label) == (0, False, None)
    assert (result.steps_seen, result.last_step) == (3, 3)
    assert result.tail_lines[-1] == b"[0] bye"


def test_crash_exit_code_is_kept(tmp_path):
    spec = child(tmp_path, "print('boom'); raise SystemExit(3)", label="7")
    result = run_attempt([spec], idle_timeout_s=10, grace_s=GRACE_S, out=io.BytesIO())
    assert (result.exit_code, result.first_failure_label, result.steps_seen) == (3, "7", 0)
    assert result.last_step is None
    assert result.tail_lines == [b"[7] boom"]


def test_death_by_signal_reads_as_128_plus_n(tmp_path):
    spec = child(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    result = run_attempt([spec], idle_timeout_s=10, grace_s=GRACE_S, out=io.BytesIO())
    assert (result.exit_code, result.first_failure_label) == (128 + 9, "0")


def test_invalid_utf8_and_a_partial_last_line_pass_through(tmp_path):
    body = r"""
        import sys
        sys.stdout.buffer.write(b"\xff\xfe not utf-8\nstep=5 no newline")
    """
    out = io.BytesIO()
    result = run_attempt([child(tmp_path, body)], idle_timeout_s=10, prefix=False, out=out)
    assert out.getvalue() == b"\xff\xfe not utf-8\nstep=5 no newline\n"
    assert (result.exit_code, result.last_step) == (0, 5)


def test_idle_watchdog_kills_the_process_and_its_grandchild(tmp_path):
    log = tmp_path / "attempt.log"
    spec = child(tmp_path, HANG_WITH_GRANDCHILD)
    result = run_attempt(
        [spec], idle_timeout_s=IDLE_S, grace_s=GRACE_S, log_path=log, out=io.BytesIO()
    )
    assert (result.exit_code, result.timed_out) == (124, True)
    # Both die of SIGTERM, so no grace period is spent.
    assert IDLE_S <= result.duration_s < IDLE_S + SLACK_S
    assert log.read_bytes() == b"[0] started\nlaunch: no output for 1 s; stopping all processes\n"
    assert eventually_dead(pids_of(tmp_path))
    assert b"launch: no output for 1 s" in log.read_bytes()


def test_start_up_has_its_own_bound_until_the_first_step_line(tmp_path):
    # Quiet for 1.5 s before its first step (start-up), then quiet again after it: the start-up
    # bound (5 s) lets the first stretch pass, the idle bound (0.5 s) ends the second.
    body = """
        import time
        time.sleep(1.5)
        print("step=1", flush=True)
        time.sleep(60)
    """
    log = tmp_path / "attempt.log"
    result = run_attempt(
        [child(tmp_path, body)],
        idle_timeout_s=0.5,
        startup_timeout_s=5,
        grace_s=GRACE_S,
        log_path=log,
        prefix=False,
        out=io.BytesIO(),
    )
    assert (result.exit_code, result.timed_out, result.last_step) == (124, True, 1)
    assert log.read_bytes() == b"step=1\nlaunch: no output for 0.5 s; stopping all processes\n"


def test_a_quiet_start_up_past_its_bound_is_an_idle_timeout(tmp_path):
    log = tmp_path / "attempt.log"
    result = run_attempt(
        [child(tmp_path, "import time; time.sleep(60)")],
        idle_timeout_s=30,
        startup_timeout_s=0.5,
        grace_s=GRACE_S,
        log_path=log,
        out=io.BytesIO(),
    )
    assert (result.exit_code, result.timed_out, result.steps_seen) == (124, True, 0)
    assert result.duration_s < 0.5 + SLACK_S  # not the 30 s idle bound
    assert log.read_bytes() == (
        b"launch: no output for 0.5 s before the first step; stopping all processes\n"
    )


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    body = """
        import os, pathlib, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pathlib.Path(__file__).with_name("pids").write_text(str(os.getpid()))
        print("ready")
        time.sleep(60)
    """
    spec = child(tmp_path, body)
    result = run_attempt([spec], idle_timeout_s=0.5, grace_s=GRACE_S, out=io.BytesIO())
    assert (result.exit_code, result.timed_out) == (124, True)
    assert 0.5 + GRACE_S <= result.duration_s < 0.5 + GRACE_S + SLACK_S
    assert eventually_dead(pids_of(tmp_path))


def test_a_stopped_process_is_woken_to_act_on_its_sigterm(tmp_path):
    # A rank stopped by SIGSTOP (goodput chaos's "hang") would sit out the whole grace period;
    # woken by SIGCONT it handles SIGTERM (here: exits at once) and the attempt ends early.
    body = """
        import os, pathlib, signal, sys
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        pathlib.Path(__file__).with_name("pids").write_text(str(os.getpid()))
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    """
    spec = child(tmp_path, body)
    result = run_attempt([spec], idle_timeout_s=0.5, grace_s=30, out=io.BytesIO())
    assert (result.exit_code, result.timed_out) == (124, True)
    assert result.duration_s < 0.5 + SLACK_S  # not 30 s of grace
    assert eventually_dead(pids_of(tmp_path))


def test_one_crash_stops_the_other_ranks(tmp_path):
    hanging = child(tmp_path, HANG_WITH_GRANDCHILD, label="0")
    # Crashes once rank 0 is up, so that there is something to stop.
    crashing = child(tmp_path, CRASH_WHEN_READY, label="1")
    result = run_attempt(
        [hanging, crashing], idle_timeout_s=None, grace_s=GRACE_S, out=io.BytesIO()
    )
    assert (result.exit_code, result.first_failure_label, result.timed_out) == (3, "1", False)
    assert result.duration_s < 10  # rank 0 was stopped (it dies of SIGTERM), not waited for
    assert eventually_dead(pids_of(tmp_path))


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_is_forwarded(tmp_path, signum, code):
    handler_before = signal.getsignal(signum)
    pids: list[int] = []
    sender = threading.Thread(
        target=lambda: (pids.extend(pids_of(tmp_path)), os.kill(os.getpid(), signum))
    )
    sender.start()
    result = run_attempt(
        [child(tmp_path, HANG_WITH_GRANDCHILD)],
        idle_timeout_s=10,
        grace_s=GRACE_S,
        out=io.BytesIO(),
    )
    sender.join()
    assert (result.exit_code, result.timed_out) == (code, False)
    assert eventually_dead(pids)
    assert signal.getsignal(signum) is handler_before


def test_runs_outside_the_main_thread_without_touching_signals(tmp_path):
    results = []
    worker = threading.Thread(
        target=lambda: results.append(
            run_attempt([child(tmp_path, "print('step=1')")], idle_timeout_s=10, out=io.BytesIO())
        )
    )
    worker.start()
    worker.join(30)
    assert results[0].exit_code == 0 and results[0].steps_seen == 1


def test_a_command_that_cannot_start_is_a_usage_error(tmp_path):
    first = child(tmp_path, HANG_WITH_GRANDCHILD)
    missing = ProcessSpec([str(tmp_path / "no-such-program")], {}, "1")
    with pytest.raises(GoodputError, match="cannot start"):
        run_attempt([first, missing], idle_timeout_s=10, grace_s=GRACE_S, out=io.BytesIO())
