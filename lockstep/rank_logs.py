"""Per-rank logging: every rank writes its own log file, lines prefixed with its rank; the main rank's
console shows INFO, the others' WARNING and above, written through tqdm so that the progress bar
(lockstep.metrics) is not torn (docs/architecture.md, "Rank roles").
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from lockstep.run_dir import unwritable_error

LOGGER_NAME = "lockstep"


class _RankFormatter(logging.Formatter):
    """Prefixes *every* line (tracebacks included) so interleaved output stays attributable."""

    def __init__(self, rank: int):
        super().__init__("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
        self.prefix = f"[rank {rank}] "

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(self.prefix + line for line in super().format(record).splitlines())


# `extra=` of a record whose traceback belongs in the rank log only: the console shows its
# message line
TRACEBACK_IN_RANK_LOG = {"traceback_in_rank_log": True}


class _ConsoleHandler(logging.Handler):
    """Writes through tqdm.write so log lines don't tear the progress bar.

    sys.stderr is looked up at emit time, so redirected/captured stderr is honoured.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if getattr(record, "traceback_in_rank_log", False):
                # a copy: the file handler formats the same record, traceback and all
                record = copy.copy(record)
                record.exc_info = record.exc_text = record.stack_info = None
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class _RankLogOnly(logging.Handler):
    """A library's records into this rank's log file, tracebacks included, never onto the console.

    The file handler is looked up at emit time: a later init_rank_logging (another run in the same
    process) gets the records, and with none set up they fall to logging's last resort (stderr).
    """

    def emit(self, record: logging.LogRecord) -> None:
        files = [
            h
            for h in logging.getLogger(LOGGER_NAME).handlers
            if getattr(h, "_lockstep", False) and isinstance(h, logging.FileHandler)
        ]
        for handler in files or [logging.lastResort]:
            if handler is not None and record.levelno >= handler.level:
                handler.handle(record)


def route_library_logs(names: Sequence[str]) -> None:
    """Send the named loggers to the rank log only, in place of the console handlers their library
    installed: a tracker's store failing mid-run logs a traceback there, and the console keeps the
    one warning that says what happened (lockstep.train.trackers)."""
    for name in names:
        library = logging.getLogger(name)
        library.handlers = [_RankLogOnly()]
        library.propagate = False


def init_rank_logging(
    run_dir: Path, rank: int, is_main: bool, level: int = logging.INFO
) -> logging.Logger:
    """Set up the "lockstep" logger: RUN_DIR/logs/rank{rank}.log on every rank, console on main
    (non-main ranks show WARNING and above on the console, so a failing rank is visible).
    Raises ConfigError when RUN_DIR cannot be written (read-only, full, no permission)."""
    logger = logging.getLogger(LOGGER_NAME)
    # Idempotent: drop the handlers a previous call installed (e.g. after an elastic restart in-process).
    for handler in [h for h in logger.handlers if getattr(h, "_lockstep", False)]:
        logger.removeHandler(handler)
        handler.close()

    log_dir = Path(run_dir) / "logs"
    try:  # a rank's first write to the run dir: a read-only or full one is reported here, in one line
        log_dir.mkdir(parents=True, exist_ok=True)
        # Append: a restarted run keeps the earlier attempt's lines, which is where the crash is.
        file_handler = logging.FileHandler(log_dir / f"rank{rank}.log", mode="a", encoding="utf-8")
    except OSError as e:
        raise unwritable_error(run_dir, e) from None
    formatter = _RankFormatter(rank)
    file_handler.setLevel(level)
    console = _ConsoleHandler(level if is_main else max(level, logging.WARNING))
    for handler in (file_handler, console):
        handler.setFormatter(formatter)
        handler._lockstep = True
        logger.addHandler(handler)

    logger.setLevel(level)
    # Root handlers (a user's basicConfig, a library's) would print every line a second time.
    logger.propagate = False
    return logger
