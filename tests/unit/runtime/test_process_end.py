"""How a lockstep process ends (lockstep/runtime/process_end.py): the race between a gloo thread dropping a hook's
callback and the interpreter's finalization, reproduced on purpose in a real process, with sys.exit and with
exit_process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Two ranks of a gloo group in one process, and an all-reduce whose Python callback holds an object that the gloo
# thread drops after the main thread has seen the result: the shape of a DDP comm hook's decompress step. Rank 1
# joins only after the callback is attached, so the callback always runs on rank 0's gloo thread (with one rank the
# op could finish first, and the callback would run inline on the main thread: CI saw that once). The object gives
# up the GIL until the interpreter is finalizing (an Event set from a finalizer), so the thread asks for the GIL
# back then.
RACE = textwrap.dedent("""
    import atexit, datetime, gc, sys, threading, time
    import torch, torch.distributed as dist
    from lockstep.runtime.process_end import exit_process
    gc.disable()  # the cycle below is collected at finalization, never earlier (finalization collects anyway)

    finalizing = threading.Event()

    class DroppedByTheGlooThread:
        def __del__(self):
            finalizing.wait(10)

    class CollectedAtFinalization:
        def __del__(self):
            finalizing.set()
            time.sleep(1)

    store, groups = dist.FileStore(sys.argv[2], 2), {}
    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))
    joining = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    [t.start() for t in joining]; [t.join() for t in joining]
    atexit.register(print, "atexit handlers ran")
    cycle = CollectedAtFinalization(); cycle.me = cycle; del cycle
    held = DroppedByTheGlooThread()
    on_gloo_thread = lambda f, held=held: (threading.current_thread() is not threading.main_thread(), f.value()[0])
    fut = groups[0].allreduce([torch.ones(2)]).get_future().then(on_gloo_thread)
    del held, on_gloo_thread
    groups[1].allreduce([torch.ones(2)])
    print("on a gloo thread:", fut.wait()[0], flush=True)
    print("sum", fut.wait()[1].tolist(), end="")  # no newline: only a flush writes it
    threading.Thread(target=lambda: (time.sleep(0.3), print(" and a thread's last words"))).start()
    (sys.exit if sys.argv[1] == "sys.exit" else exit_process)(0)
""")


def _race(tmp_path, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "race.py"
    script.write_text(RACE)
    # without coverage's measurement (`pytest --cov` starts it in every subprocess through this
    # variable): its exit handler saves data while the gloo thread waits, and the race is gone
    env = {k: v for k, v in os.environ.items() if k != "COVERAGE_PROCESS_CONFIG"}
    return subprocess.run(
        [sys.executable, str(script), how, str(tmp_path / f"store-{how}")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "PYTHONFAULTHANDLER": ""},
    )


def test_a_gloo_thread_still_dropping_a_callback_does_not_abort_the_exit(tmp_path):
    # the failure itself: sys.exit finalizes the interpreter while the gloo thread waits for the GIL -> SIGABRT
    plain = _race(tmp_path, "sys.exit")
    assert plain.returncode == -6, plain
    assert "terminate called without an active exception" in plain.stderr
    # exit_process: the exit code of a clean exit; non-daemon threads, atexit handlers and unflushed output kept
    ended = _race(tmp_path, "exit_process")
    assert ended.returncode == 0, ended.stderr
    assert (
        ended.stdout
        == "on a gloo thread: True\nsum [2.0, 2.0] and a thread's last words\natexit handlers ran\n"
    )
    assert "terminate" not in ended.stderr


def test_exit_process_without_a_group_skips_finalization_alone(tmp_path):
    # no group: the same end (what sys.exit does up to finalization), so the `__del__` of an object still
    # held is the one thing that does not run; the exit code, atexit, threads and buffered output are kept
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, sys, threading, time
        from lockstep.runtime.process_end import exit_process
        class WritesWhenFinalized:
            def __del__(self):
                print("finalized")
        keep = WritesWhenFinalized()
        class Unreachable:
            def __del__(self):
                print("collected", end=" ")
        cycle = Unreachable(); cycle.me = cycle; del cycle
        atexit.register(print, "atexit")
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread", end=" "))).start()
        print("buffered", end=" ")
        exit_process(3)
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        3,
        "buffered thread collected atexit\n",
        "",
    )
