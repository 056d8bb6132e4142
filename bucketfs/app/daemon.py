"""Running a mount as a process: logging, daemonising, and the readiness report.

Invariants: a daemonised mount reports READY, or its error as one line, on a pipe to
the `bucketfs mount` that forked it, which returns only then (with READY, printing the
warnings logged before it, one line each); a Ctrl-C of that command
stops the daemon (nothing is left mounted or running), and a daemon whose command is
gone takes its failed report as cancelled. A daemon's log goes to --log-file or syslog,
and the user hears once when it has nowhere to go.
"""

from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import signal
import stat as stat_mod
import sys
from typing import Callable

from bucketfs import errors
from bucketfs.config import Config

log = logging.getLogger(__name__)

SYSLOG_SOCKET = "/dev/log"
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class GoneRequests(logging.Filter):
    """pyfuse3 logs at ERROR a reply the kernel no longer waited for (`fuse_reply_*`
    failed with ENOENT): its reader was interrupted, or the mount was going away with
    READs in flight. Not an error of the daemon's: logged at DEBUG."""

    GONE = "fuse_reply_* failed with " + os.strerror(errno.ENOENT)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.getMessage().endswith(self.GONE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def syslog_available() -> bool:
    try:
        return stat_mod.S_ISSOCK(os.stat(SYSLOG_SOCKET).st_mode)
    except OSError:
        return False


def setup_logging(config: Config, daemon: bool) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    handler: logging.Handler
    if config.log_file:
        # Watched: once logrotate has renamed the file, the next line opens a new one
        # by itself (no SIGHUP, no copytruncate). With --foreground too: the user asked.
        handler = logging.handlers.WatchedFileHandler(config.log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s " + LOG_FORMAT))
    elif not daemon:
        handler = logging.StreamHandler(sys.stderr)
        # Under systemd stderr goes to the journal, which stamps each line itself.
        stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
        handler.setFormatter(logging.Formatter(stamp + LOG_FORMAT))
    elif syslog_available():
        handler = logging.handlers.SysLogHandler(SYSLOG_SOCKET)
        handler.setFormatter(logging.Formatter("bucketfs[%(process)d]: " + LOG_FORMAT))
    else:
        handler = logging.NullHandler()  # (wait_for_daemon tells the user, once mounted)
    root.addHandler(handler)
    root.setLevel(config.log_level)
    # SDK debug logs carry request signatures and headers: never let them through.
    for noisy in ("botocore", "boto3", "urllib3", "google", "s3transfer"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    pyfuse3_log = logging.getLogger("pyfuse3")
    if not any(isinstance(f, GoneRequests) for f in pyfuse3_log.filters):
        pyfuse3_log.addFilter(GoneRequests())


def log_is_kept(config: Config) -> bool:
    """A daemon's log goes somewhere: --log-file, or syslog."""
    return bool(config.log_file) or syslog_available()


def check_log_file(path: str) -> None:
    """Open --log-file here, before forking or serving: the daemon's stderr is /dev/null,
    so its failure to open it would only show as "the daemon exited"."""
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise errors.UserError(f"--log-file {path}: {exc.strerror}", errors.EXIT_USAGE) from None


# The cyclic collector's first threshold (net new container objects between two young
# collections). At CPython's 700, a cold 32-thread epoch of 10,000 files through a real
# mount ran ~700 collections, 5-6 of them full ones (~55 ms each): 0.42-0.54 s of the
# daemon's CPU, ~0.05 ms a file. At 20,000: 11 young ones and no full one, 0.13-0.14 s
# (ad hoc, 2026-11-27). The daemon's garbage is freed by reference counts; the few
# cycles it makes (exceptions and their frames) wait a little longer.
GC_YOUNG_THRESHOLD = 20_000


def serve_here(config: Config, on_ready, backend_factory=None) -> int:
    """Mount and serve in this process until unmounted (mount.serve); `backend_factory`
    as there (None: the store's backend)."""
    import functools
    import gc

    import trio

    from bucketfs import allocator
    from bucketfs.app import mount

    allocator.tune()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    factory = {} if backend_factory is None else {"backend_factory": backend_factory}
    trio.run(functools.partial(mount.serve, config, on_ready, **factory))
    return errors.EXIT_OK


# How long a Ctrl-C'd `bucketfs mount` waits for its daemon to stop: one still probing
# the store dies at SIGTERM; one that has just mounted detaches (no file is open yet).
DAEMON_STOP_TIMEOUT_S = 10.0


def daemonise(config: Config) -> int:
    """Fork; the child mounts and reports readiness or its error through a pipe."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _run_daemon(config, write_fd)  # (never returns)
    os.close(write_fd)
    # A Ctrl-C stops this wait and the daemon (wait_for_daemon) even if SIGINT was
    # ignored at start, as a script's background job has it: Python then installs no
    # handler, and the signal was lost while the probe hung. (mount.py takes SIGINT
    # whatever it inherits, as this does.)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return wait_for_daemon(config, pid, read_fd)


def _run_daemon(config: Config, write_fd: int) -> None:
    """The forked child: detach, mount, report READY or the error on `write_fd`, exit."""
    os.setsid()
    # Do not pin the filesystem we were started from (it could not be unmounted
    # while the mount lives). Every path in config is absolute already.
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    setup_logging(config, daemon=True)
    report = os.fdopen(write_fd, "w")

    def tell_parent(line: str) -> None:
        try:
            report.write(" ".join(line.split()) + "\n")  # one line: the report is line-based
            report.flush()
        except OSError:
            pass  # the parent is gone: nobody to tell

    startup_warnings = StartupWarnings(tell_parent)
    logging.getLogger().addHandler(startup_warnings)

    def on_ready():
        logging.getLogger().removeHandler(startup_warnings)
        # A BrokenPipeError here (the parent is gone) cancels the mount: mount.py.
        report.write("READY\n")
        report.flush()

    code = errors.EXIT_FAILURE
    try:
        code = serve_here(config, on_ready)
    except errors.UserError as exc:
        code = exc.exit_code
        tell_parent(f"ERROR {exc.exit_code} {exc}")
    except BaseException as exc:  # noqa: BLE001 - the parent must hear of it, the log gets the trace
        log.exception("bucketfs daemon failed")
        trace = "the log has the trace" if log_is_kept(config) else "--foreground shows the trace"
        tell_parent(f"ERROR {errors.EXIT_FAILURE} daemon failed ({type(exc).__name__}: {exc}); {trace}")
    finally:
        try:
            report.close()
        except OSError:
            pass
        os._exit(code)


class StartupWarnings(logging.Handler):
    """Warnings the daemon logs before its mount answers (an empty prefix, a cache
    directory it cannot use) go to the terminal that started it, not only to a log
    the user may never read."""

    def __init__(self, tell_parent: Callable[[str], None]):
        super().__init__(logging.WARNING)
        self.tell_parent = tell_parent

    def emit(self, record: logging.LogRecord) -> None:
        self.tell_parent("WARNING " + record.getMessage())


def wait_for_daemon(config: Config, pid: int, read_fd: int) -> int:
    """The parent: wait for the daemon's report on `read_fd`; its exit code or UserError."""
    report = os.fdopen(read_fd)
    try:
        warnings = []  # said with the success only: an error stays one line
        line = report.readline().strip()
        while line.startswith("WARNING "):
            warnings.append(line.split(" ", 1)[1])
            line = report.readline().strip()
    except KeyboardInterrupt:
        # Ctrl-C before the mount answered: the daemon is in another session and never
        # saw it. Closing the pipe first makes its readiness report fail, which it
        # takes as cancelled, should it mount before the SIGTERM lands.
        report.close()
        stop_daemon(pid)
        raise errors.UserError("interrupted", errors.EXIT_INTERRUPTED) from None
    report.close()
    if line == "READY":
        for warning in warnings:
            print(f"bucketfs: warning: {warning}", file=sys.stderr)
        if not log_is_kept(config):
            # Containers and minimal hosts have no syslog: said once, where it is seen,
            # rather than a default log file in a place the user never chose. Said with
            # the success only: an error stays one line (and says where to look).
            print(
                f"bucketfs: warning: no syslog here ({SYSLOG_SOCKET} is missing), so the daemon's log is "
                "discarded; add --log-file PATH to keep it",
                file=sys.stderr,
            )
        return errors.EXIT_OK
    if line.startswith("ERROR "):
        _, code, message = line.split(" ", 2)
        raise errors.UserError(message, int(code))
    _, status = os.waitpid(pid, 0)
    raise errors.UserError(
        f"mount failed: the daemon exited ({os.waitstatus_to_exitcode(status)}) before the mount answered",
        errors.EXIT_MOUNT_FAILED,
    )


def stop_daemon(pid: int) -> None:
    """SIGTERM the daemon child and reap it, waiting at most DAEMON_STOP_TIMEOUT_S."""
    import select

    try:
        pidfd = os.pidfd_open(pid)  # readable once the child has exited
    except OSError:
        return
    try:
        os.kill(pid, signal.SIGTERM)
        try:
            exited = select.select([pidfd], [], [], DAEMON_STOP_TIMEOUT_S)[0]
        except KeyboardInterrupt:
            exited = []  # a second Ctrl-C: stop waiting
        if exited:
            os.waitpid(pid, 0)
        else:
            print(f"bucketfs: the daemon (pid {pid}) is still stopping", file=sys.stderr)
    finally:
        os.close(pidfd)
