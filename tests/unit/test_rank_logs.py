"""lockstep/rank_logs.py: every rank's log file with its prefix, the console of the main rank and of the others,
a traceback kept to the rank log, a library's records routed there, and a first write to a read-only run
directory refused in one line."""

import logging

import pytest
from conftest import TINY, run_main
from tmpfs import read_only, tmpfs

from lockstep.errors import ConfigError
from lockstep.rank_logs import (
    LOGGER_NAME,
    TRACEBACK_IN_RANK_LOG,
    init_rank_logging,
    route_library_logs,
)

from .test_run_dir import one_line_error


@pytest.fixture(autouse=True)
def clean_logger():
    """The "lockstep" logger is process-wide: leave no handlers (open files) behind."""
    yield
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


# ----------------------------------------------------------------------------- logging


def test_rank_log_file_prefixes_every_line(tmp_path):
    logger = init_rank_logging(tmp_path, rank=1, is_main=False)
    logger.info("hello")
    logger.warning("two\nlines")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    lines = (tmp_path / "logs" / "rank1.log").read_text().splitlines()
    assert len(lines) > 5  # traceback lines included
    assert all(line.startswith("[rank 1] ") for line in lines)
    assert "INFO hello" in lines[0]
    assert any("RuntimeError: boom" in line for line in lines)


def test_init_twice_does_not_duplicate(tmp_path, capsys):
    init_rank_logging(tmp_path, rank=0, is_main=True)
    logger = init_rank_logging(tmp_path, rank=0, is_main=True)
    logger.info("once")
    text = (tmp_path / "logs" / "rank0.log").read_text()
    assert text.count("once") == 1
    assert capsys.readouterr().err.count("once") == 1


def test_a_ranks_first_write_to_a_read_only_run_dir(
    tmp_path, corpus, token_cache, monkeypatch, capsys
):
    """Under a launcher the CLI leaves the check to each rank: its first write (the log) says it, in
    one line."""
    with tmpfs(tmp_path / "mnt") as mnt:
        run = mnt / "run"
        (run / "logs").mkdir(parents=True)
        (run / "logs" / "rank0.log").write_text("an earlier attempt\n")  # appended to, normally
        read_only(mnt)
        with pytest.raises(
            ConfigError, match=f"run directory {run} cannot be written: Read-only file system"
        ):
            init_rank_logging(run, 0, True)
        env = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29999",
            "TORCHELASTIC_RUN_ID": "read-only-test",
        }
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        code, _, err = run_main(
            capsys,
            "train",
            "--data",
            corpus,
            "--output-dir",
            run,
            *TINY,
            "--global-batch-size",
            "8",
            "--max-steps",
            "2",
            "--save-interval",
            "2",
            "--set",
            f"data.cache_dir={token_cache}",
        )
        line = one_line_error(code, err, run)
        assert f"({run / 'logs' / 'rank0.log'})" in line


def test_main_rank_console_shows_info(tmp_path, capsys):
    logger = init_rank_logging(tmp_path, rank=0, is_main=True)
    logger.info("progress")
    err = capsys.readouterr().err
    assert "[rank 0]" in err and "progress" in err


def test_non_main_console_shows_only_warnings(tmp_path, capsys):
    logger = init_rank_logging(tmp_path, rank=3, is_main=False)
    logger.info("quiet")
    logger.warning("loud")
    err = capsys.readouterr().err
    assert "quiet" not in err
    assert "[rank 3]" in err and "loud" in err
    # the file still has both
    text = (tmp_path / "logs" / "rank3.log").read_text()
    assert "quiet" in text and "loud" in text


def test_a_traceback_marked_for_the_rank_log_stays_off_the_console(tmp_path, capsys):
    logger = init_rank_logging(tmp_path, rank=0, is_main=True)
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        logger.warning("the tracker stopped", exc_info=True, extra=TRACEBACK_IN_RANK_LOG)
        # unmarked: the console shows its traceback as before
        logger.warning("a crash", exc_info=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith(" WARNING the tracker stopped"), err
    assert err[1].endswith(" WARNING a crash"), err
    assert err[-1] == "[rank 0] OSError: [Errno 28] No space left on device"
    assert err.count(err[-1]) == 1
    text = (tmp_path / "logs" / "rank0.log").read_text()
    assert text.count("Traceback (most recent call last)") == 2
    assert text.count("OSError: [Errno 28]") == 2


def test_a_routed_library_logs_into_the_rank_log_only(tmp_path, capsys):
    library = logging.getLogger("lockstep_test_library")
    # the library's own console handler, as MLflow installs one
    library.addHandler(logging.StreamHandler())
    library.setLevel(logging.INFO)
    init_rank_logging(tmp_path, rank=2, is_main=True)
    route_library_logs(["lockstep_test_library"])
    try:
        raise RuntimeError("disk full")
    except RuntimeError:
        library.error("database error", exc_info=True)
    library.debug("below the library's level")
    assert capsys.readouterr().err == ""
    lines = (tmp_path / "logs" / "rank2.log").read_text().splitlines()
    assert lines[0].endswith(" ERROR database error")
    assert lines[-1] == "[rank 2] RuntimeError: disk full"
    assert "below the library's level" not in "\n".join(lines)
    # no rank log any more (the run ended in this process): a warning falls to logging's last resort
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    library.info("after the run")
    library.warning("still visible")
    assert capsys.readouterr().err == "still visible\n"
