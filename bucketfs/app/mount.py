"""Mount lifecycle: serving, readiness, signals, clean unmount.

Invariants:
- Everything that can be checked before attaching the mount is checked first
  (mountpoint, /dev/fuse, fusermount3: mountpoints.py; then the bucket, or with
  --index the index and one HEAD, no LIST), so a bad input leaves nothing mounted.
- `on_ready` is called only once the mount answers a stat from another thread.
- The backend comes from a factory (`serve(backend_factory=...)`, the store's by
  default), so a whole mount can run on the in-memory backend.
- SIGTERM/SIGINT end the FUSE loop; the mount is then detached (lazily if busy:
  libfuse unmounts with MNT_DETACH) and the process exits 0. SIGHUP does too only in
  a terminal's foreground (the terminal hung up); anywhere else (daemonised, systemd)
  it is logrotate's signal and the mount keeps serving.
- SIGINT before the mount is attached ends the process at once (exit 130): nothing
  is mounted yet, and a probe of a hung store must not hold a Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import logging.handlers
import os
import signal
import socket
import sys
import tempfile
from typing import Callable, Optional

import pyfuse3
import trio

from bucketfs import allocator, errors
from bucketfs.app import indexload
from bucketfs.app.mountpoints import FUSE_TYPE, FUSECTL_DIR, fusectl_dir, mount_entry, unmount
from bucketfs.backends import Backend, make_backend
from bucketfs.config import Config, is_url, parse_object_url
from bucketfs.core.filesystem import Filesystem
from bucketfs.diskcache.directory import CacheDir, claim_dir, mount_identity
from bucketfs.fuse.ops import FuseOperations

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
# After SIGTERM the mount is detached at once; readers already mid-file get this long
# to finish (the kernel keeps a detached mount alive while files are open) before
# the daemon stops serving them. Below systemd's default 90 s stop timeout.
SHUTDOWN_GRACE_S = 30.0
# Once the loop is told to stop (second signal, or the grace period over), pyfuse3
# still waits for every handler in flight, and one blocked on a store that stopped
# answering returns only after --read-timeout x --retries (150 s by default), past the
# unit's TimeoutStopSec=45. Past this deadline the process exits at once: the kernel
# then fails the blocked reads (ENOTCONN) rather than the daemon lingering.
# 30 + 3 s stays within TimeoutStopSec.
STOP_DEADLINE_S = 3.0
# fusermount3 -uz normally takes milliseconds; bounded so a hard stop stays prompt.
UNMOUNT_DEADLINE_S = 5.0
# After the FUSE loop ends, how long queued disk-cache writes may take to land (64 MiB
# at most are queued; a disk that cannot write them in this long loses them). With
# SHUTDOWN_GRACE_S and STOP_DEADLINE_S: 43 s, within the unit's TimeoutStopSec=45.
FINISH_WRITES_DEADLINE_S = 10.0
# A mount from an index probes the store with one HEAD (no LIST), answered within this
# (check_bucket's own probe takes as long against a black-holed address).
INDEX_PROBE_DEADLINE_S = 30.0
# Kernel read-ahead for the mount's bdi: larger than the 128 KiB default so a
# sequential reader's READs arrive in big batches; the daemon's own prefetcher
# does the real read-ahead.
KERNEL_READ_AHEAD_KB = 4096
# The kernel sends read-ahead READs as "background" requests, at most 12 in flight
# per mount (FUSE_DEFAULT_MAX_BACKGROUND) unless the daemon's INIT reply says more,
# and pyfuse3 never does: 32 loader threads reading small files then wait on 12
# READs at a time. fusectl lets root raise it per connection after mounting.
FUSE_MAX_BACKGROUND_MIN = 64
DISK_CACHE_SWITCH_INTERVAL_S = 0.0005  # see serve(): lets disk-cache writes keep up


# -- systemd readiness ----------------------------------------------------------
def sd_notify(message: str) -> None:
    """Send `message` to systemd's NOTIFY_SOCKET if we run under Type=notify."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("could not notify systemd: %s", exc)


def raise_kernel_readahead(dev: int) -> None:
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(KERNEL_READ_AHEAD_KB))
    except OSError as exc:
        log.debug("could not raise %s: %s", path, exc)


def raise_fuse_background(dev: int, max_background: int) -> None:
    """Raise the background-request limit of the mount on `dev` through fusectl (root
    only), mounting fusectl first where the host has not (systemd mounts it at boot)."""
    conn_dir = fusectl_dir(dev)
    if not os.path.isdir(conn_dir) and os.geteuid() == 0 and os.path.isdir(FUSECTL_DIR):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.mount(b"fusectl", FUSECTL_DIR.encode(), b"fusectl", 0, None) != 0:
            log.debug("could not mount fusectl on %s: %s", FUSECTL_DIR, os.strerror(ctypes.get_errno()))
    # Congested (3/4 full) makes the kernel skip optional read-ahead: keep that ratio.
    for name, value in (("max_background", max_background), ("congestion_threshold", max_background * 3 // 4)):
        try:
            with open(os.path.join(conn_dir, name), "w") as f:
                f.write(str(value))
        except OSError as exc:
            log.info("could not raise the FUSE %s (%s): concurrent reads of small files are capped at 12", name, exc)
            return


# -- signals ----------------------------------------------------------------------
# Until the signal watcher holds SIGINT, a Ctrl-C ends the process at once: trio would
# deliver it only once a worker thread (the bucket probe, up to its timeouts on a hung
# store) returns. Nothing is mounted before the watcher runs (it starts before
# pyfuse3.init), so there is nothing to undo. Cleared when the watcher takes over.
_sigint_exits_now = [True]


def _on_sigint_at_startup(signum, frame) -> None:
    if not _sigint_exits_now[0]:
        return  # the stop is under way, bounded by STOP_DEADLINE_S: a further Ctrl-C waits for it
    os.write(2, b"bucketfs: interrupted\n")
    os._exit(errors.EXIT_INTERRUPTED)


def _on_sigterm_outside_the_watcher(signum, frame) -> None:
    """SIGTERM when the watcher does not hold it: before it runs (nothing mounted yet:
    end as SIGTERM's default would), or after it closed, when the process is already
    on its way out (the FUSE loop ended, or a second signal came), bounded by
    STOP_DEADLINE_S and FINISH_WRITES_DEADLINE_S: then ignored. With the default
    action there, a SIGTERM arriving just as the watcher let go killed a stopping
    daemon with -15 instead of its exit 0 (seen once in the second-signal test)."""
    if _sigint_exits_now[0]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def has_controlling_terminal() -> bool:
    try:
        os.close(os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY))
        return True
    except OSError:
        return False  # daemonised (setsid), under systemd, or started without a terminal


def hangup_stops(config) -> bool:
    """SIGHUP means "your terminal is gone" only to a foreground mount that has one;
    to a daemon or a systemd service it can only be a deliberate kill -HUP (logrotate)."""
    return config.foreground and has_controlling_terminal()


def _install_startup_signal_handlers(hangup_stops: bool) -> None:
    _sigint_exits_now[0] = True
    signal.signal(signal.SIGINT, _on_sigint_at_startup)
    signal.signal(signal.SIGTERM, _on_sigterm_outside_the_watcher)
    if not hangup_stops:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (the watcher logs it once mounted)


def _reopen_log_files() -> None:
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.handlers.WatchedFileHandler):
            handler.reopenIfNeeded()


# -- serving ----------------------------------------------------------------------
def fuse_option_value(text: str) -> str:
    """`text` escaped for libfuse's option parser, which splits at ',' and reads '\\'
    as escaping the next character and '\\ooo' as an octal byte. Every byte but
    printable ASCII goes as '\\ooo': pyfuse3 passes options as ASCII, and a URL may not
    be (a key prefix is any UTF-8)."""
    return "".join(
        chr(byte) if 0x20 < byte < 0x7F and byte not in b"\\," else f"\\{byte:03o}"
        for byte in text.encode("utf-8", "surrogateescape")
    )


def fuse_options(config) -> set:
    options = set(pyfuse3.default_options)
    fsname = fuse_option_value(config.source or str(config.url))
    options |= {"ro", f"fsname={fsname}", f"subtype={FUSE_TYPE.split('.')[1]}"}
    if config.allow_other:
        options.add("allow_other")
    return options


async def empty_prefix_notice(backend, url) -> str:
    """What to tell the user whose prefix lists nothing: a mistyped prefix would
    otherwise reach the training script as "Found 0 files", far from its cause. One
    request more, in this case only: is the prefix an object's key?"""
    if url.prefix:
        try:
            await backend.stat(url.prefix[:-1])
        except errors.BucketfsError:
            pass
        else:
            return (
                f"{url} is empty: {url.scheme}://{url.bucket}/{url.prefix[:-1]} is an object, not a "
                "folder (mount the folder that holds it)"
            )
    return f"{url} is empty: nothing is stored under it (a mistyped prefix?)"


async def probe_with_index(backend, config, index) -> None:
    """The probe of a mount from an index, with no LIST: a HEAD of one object it names
    (none is needed when the index itself came from the mounted bucket). A missing
    bucket or denied access are the user's errors as without an index; an object that
    is gone is a warning (the index is older than the store: reads of what changed
    give ESTALE), after one LIST tells it from a missing bucket."""
    log.info(
        "%s: listings from the index %s (built %s; %d objects in %d directories): no LIST",
        config.url,
        config.index,
        index.built_at,
        index.objects_count,
        index.directories_count,
    )
    if index.objects_count == 0:
        log.warning("%s: the index %s holds no object: the mount is empty", config.url, config.index)
    if index.first_key is None:
        return
    if is_url(config.index) and parse_object_url(config.index)[1] == config.url.bucket:
        return  # (the index's own GET from this bucket answered)
    key = config.url.prefix + index.first_key
    try:
        with trio.fail_after(INDEX_PROBE_DEADLINE_S):
            await backend.stat(key)
    except trio.TooSlowError:
        raise errors.EndpointUnreachable(f"no answer within {INDEX_PROBE_DEADLINE_S:.0f} s") from None
    except errors.NotFound:
        await backend.check_bucket(config.url.prefix)  # (BucketNotFound if that is why)
        log.warning(
            "%s: the index %s (built %s) names %s, which the store no longer has: the index is older than the "
            "objects (reads of what changed since give ESTALE; build it again)",
            config.url,
            config.index,
            index.built_at,
            key,
        )


async def serve(
    config,
    on_ready: Callable[[], None],
    on_fs: Optional[Callable] = None,
    backend_factory: Callable[[Config], Backend] = make_backend,
) -> None:
    """Check the bucket, mount, serve until unmounted or signalled, then clean up.

    `backend_factory(config)` builds the backend the mount reads (by default the
    store's: make_backend); a test gives one that builds an in-memory backend, and the
    whole mount, FUSE included, runs on it with no store.

    Raises UserError for problems the user must fix (nothing is left mounted).
    """
    hangup = hangup_stops(config)  # (once: it opens /dev/tty)
    _install_startup_signal_handlers(hangup)
    # The user named an endpoint (an option or the SDKs' own variables): an odd answer
    # points at it; otherwise at something between us and the default endpoint.
    endpoint_given = bool(
        config.endpoint_url
        or any(os.environ.get(name) for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST"))
    )
    try:
        # Inside the handling: a missing --profile or an endpoint/region botocore refuses
        # fails here, and must be one line, not a traceback.
        backend = backend_factory(config)
    except errors.BucketfsError as exc:
        raise errors.user_error_for(exc, str(config.url), endpoint_given) from None
    index = None
    try:
        if config.index:
            index = await indexload.load_index(config.index, config, backend)
            await probe_with_index(backend, config, index)
        elif not await backend.check_bucket(config.url.prefix):
            log.warning("%s", await empty_prefix_notice(backend, config.url))
    except errors.UserError:
        await backend.aclose()
        raise
    except errors.BucketfsError as exc:
        await backend.aclose()
        raise errors.user_error_for(exc, str(config.url), endpoint_given) from None
    if not config.cache_dir:
        return await _serve(config, backend, None, on_ready, on_fs, hangup, index)
    try:
        # One directory per bucket URL and endpoint, kept for the next mount of them
        # (claimed once the bucket is known to exist: a typo leaves nothing behind).
        # Shared with the other mounts of them on this host while this process lives.
        cache_dir = claim_dir(config.cache_dir, *mount_identity(config.url, config.endpoint_url))
    except errors.UserError:
        await backend.aclose()
        raise
    if cache_dir is None:  # (no room on its disk for a directory: logged)
        return await _serve(config, backend, None, on_ready, on_fs, hangup, index)
    # Disk-cache writes run in worker threads that need the GIL back after every
    # syscall. At the default 5 ms switch interval a busy event loop holds them off
    # and writes fall behind: 33% of a 440 files/s cold epoch was never stored.
    # At 0.5 ms all of it was, at about the same files/s.
    sys.setswitchinterval(DISK_CACHE_SWITCH_INTERVAL_S)
    try:
        await _serve(config, backend, cache_dir, on_ready, on_fs, hangup, index)
    finally:
        cache_dir.close()  # (a private one is removed: no later mount will find it)


async def _serve(
    config,
    backend,
    cache_dir: Optional[CacheDir],
    on_ready: Callable[[], None],
    on_fs: Optional[Callable],
    hangup_stops: bool,
    index=None,
) -> None:
    mounted = False
    detached: list = []  # set by the signal handler once it has lazily unmounted
    try:
        async with trio.open_nursery() as nursery:
            fs = Filesystem(
                backend,
                config,
                nursery,
                disk_cache_dir=cache_dir.path if cache_dir else None,
                disk_cache_dir_fd=cache_dir.fd if cache_dir else None,
                disk_cache_alone=cache_dir.alone if cache_dir else True,
                listing_index=index,
            )
            ops = FuseOperations(fs, config)
            if config.metrics_port:
                # Bound before mounting: a port in use fails the mount with one line
                # rather than ending a mount that is already serving.
                _start_metrics(config.metrics_address, config.metrics_port, fs.snapshot)
            # Signals from here on are the watcher's: one that arrives before the FUSE
            # loop runs is handled once it does, so nothing is left mounted.
            watcher = trio.CancelScope()  # ended with the FUSE loop: the writes below are not a hung stop
            await nursery.start(_watch_signals, config.mountpoint, detached, hangup_stops, watcher)
            _mount(ops, config)
            mounted = True
            ops.start(nursery)
            nursery.start_soon(allocator.trim_periodically)
            nursery.start_soon(fs.release_idle_inode_handles_periodically)
            log.info("mounted %s on %s", config.url, config.mountpoint)
            if on_fs is not None:
                on_fs(fs, nursery)
            max_background = max(FUSE_MAX_BACKGROUND_MIN, 2 * config.max_connections_count)
            nursery.start_soon(_announce_ready, config.mountpoint, max_background, on_ready)
            try:
                await pyfuse3.main(min_tasks=4, max_tasks=256)
            except* (ConnectionAbortedError, ConnectionResetError):
                # An unmount while replies (RELEASE of just-closed files) were still
                # queued: the kernel aborts the connection. The mount is gone, which
                # is what was asked for; nothing is lost on a read-only mount.
                log.info("FUSE connection closed by the kernel")
            log.info("FUSE loop ended; unmounting %s", config.mountpoint)
            sd_notify("STOPPING=1")
            # The READs the daemon's own tasks serve (fuse/replies.py) end too, or the
            # process ends as it does for pyfuse3's own handlers still in flight.
            with trio.move_on_after(STOP_DEADLINE_S) as waited:
                await ops.reads_done()
            if waited.cancelled_caught:
                await _exit_now(config.mountpoint)
            watcher.cancel()
            with trio.move_on_after(FINISH_WRITES_DEADLINE_S):
                await fs.finish_writes()
            nursery.cancel_scope.cancel()
    except* errors.UserError as group:
        # A problem the user must fix, found inside the nursery (an unreadable disk
        # cache, a mount the kernel refused): trio wraps it in a group; the CLI wants
        # the one line it carries.
        raise group.exceptions[0] from None
    finally:
        if mounted:
            ops.stop()  # (the nursery's READ tasks have ended: their replies are written before the session goes)
            pyfuse3.close(unmount=not detached)
            log.info("unmounted %s", config.mountpoint)
        with trio.CancelScope(shield=True):
            await backend.aclose()


def _mount(ops, config) -> None:
    """pyfuse3.init, with libfuse's and fusermount3's own reason for a refusal in the
    error: they write it to stderr, which is /dev/null in a daemon."""
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        saved_stderr_fd = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            pyfuse3.init(ops, config.mountpoint, fuse_options(config))
            failure = None
        except RuntimeError as exc:
            failure = exc
        finally:
            sys.stderr.flush()
            os.dup2(saved_stderr_fd, 2)
            os.close(saved_stderr_fd)
        captured.seek(0)
        said = captured.read().decode(errors="replace").strip()
    if failure is None:
        if said:
            print(said, file=sys.stderr)  # (a warning of libfuse's, or a log line of ours meanwhile)
        return
    reason = " ".join(said.splitlines()[-1].split()) if said else str(failure)
    raise errors.UserError(
        f"mount {config.mountpoint} failed: {reason} (check that /dev/fuse works here - a container needs "
        "--device /dev/fuse --cap-add SYS_ADMIN - and, for a user other than root, that fusermount3 is "
        "installed setuid root and /etc/fuse.conf's mount_max is not reached)",
        errors.EXIT_MOUNT_FAILED,
    )


def _start_metrics(address: str, port: int, snapshot) -> None:
    from bucketfs.metrics import start_metrics_server

    try:
        start_metrics_server(address, port, snapshot)
    except OSError as exc:
        where = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        raise errors.UserError(
            f"--metrics-port {port}: cannot serve metrics on {where} ({exc.strerror})", errors.EXIT_METRICS_PORT
        ) from None


async def _watch_signals(
    mountpoint: str, detached: list, hangup_stops: bool, scope: trio.CancelScope, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    with scope:
        await _stop_on_signals(mountpoint, detached, hangup_stops, task_status)


async def _stop_on_signals(mountpoint: str, detached: list, hangup_stops: bool, task_status) -> None:
    """First signal: detach the mount (no new opens) and let open files finish; the
    FUSE loop ends by itself when the last one closes. A second signal, or the grace
    period running out, ends it at once. SIGHUP counts only if `hangup_stops`;
    otherwise it reopens --log-file and the mount serves on."""
    stop_signals = {signal.SIGTERM, signal.SIGINT} | ({signal.SIGHUP} if hangup_stops else set())

    async def next_stop_signal(signals) -> str:
        async for signum in signals:
            if signum in stop_signals:
                return signal.Signals(signum).name
            _reopen_log_files()
            log.info("received SIGHUP; log file reopened, the mount serves on (SIGTERM stops it)")
        raise AssertionError("a signal receiver never ends")

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        # From here on, once this receiver is closed too, the startup handler ignores
        # SIGINT: the stop is bounded by the deadline below.
        _sigint_exits_now[0] = False
        task_status.started()
        name = await next_stop_signal(signals)
        log.info("received %s; detaching %s (open files may finish for %.0f s)", name, mountpoint, SHUTDOWN_GRACE_S)
        sd_notify("STOPPING=1")
        try:
            # Under systemd, ExecStop (bucketfs unmount --lazy) has usually detached it already.
            if await trio.to_thread.run_sync(os.path.ismount, mountpoint):
                await trio.to_thread.run_sync(unmount, mountpoint, True)
            detached.append(True)
        except errors.UserError as exc:
            log.warning("%s; stopping now", exc)
        if detached:
            with trio.move_on_after(SHUTDOWN_GRACE_S):
                log.info("received %s again; stopping now", await next_stop_signal(signals))
    pyfuse3.terminate()
    # Cancelled when the FUSE loop ends in time (the nursery is cancelled then).
    await trio.sleep(STOP_DEADLINE_S)
    await _exit_now(mountpoint)


async def _exit_now(mountpoint: str) -> None:
    """Handlers are still blocked (on a store that stopped answering): detach the mount
    if the first signal has not, and end the process without waiting for them."""
    log.warning(
        "requests still in flight %.0f s after stopping (a store that stopped answering?); "
        "exiting now: their readers get an error",
        STOP_DEADLINE_S,
    )
    with trio.move_on_after(UNMOUNT_DEADLINE_S):
        try:
            if await trio.to_thread.run_sync(mount_entry, mountpoint, abandon_on_cancel=True) is not None:
                await trio.to_thread.run_sync(unmount, mountpoint, True, UNMOUNT_DEADLINE_S, abandon_on_cancel=True)
        except (errors.UserError, OSError) as exc:
            log.warning("%s", exc)  # closing /dev/fuse below leaves a dead mount: a new mount recovers it
    logging.shutdown()  # os._exit skips flushing the log handlers
    os._exit(errors.EXIT_OK)  # the stop was asked for, and done


def _open_directory(path: str) -> None:
    os.close(os.open(path, os.O_RDONLY | os.O_DIRECTORY))


async def _announce_ready(mountpoint: str, max_background: int, on_ready: Callable[[], None]) -> None:
    parent_dev = os.stat(os.path.dirname(os.path.abspath(mountpoint)) or "/").st_dev
    with trio.move_on_after(READY_TIMEOUT_S) as scope:
        while True:
            # stat from a worker thread: the trio thread must stay free to answer it.
            st = await trio.to_thread.run_sync(os.stat, mountpoint)
            if st.st_dev != parent_dev:
                break
            await trio.sleep(0.01)  # the kernel has not attached the mount yet: poll with a deadline
    if scope.cancelled_caught:
        log.error("mount did not answer within %.0f s", READY_TIMEOUT_S)
        pyfuse3.terminate()
        return
    # st_dev of the mount from the stat above: a stat of the mountpoint here, on the
    # trio thread that serves it, could wait on itself.
    raise_kernel_readahead(st.st_dev)
    raise_fuse_background(st.st_dev, max_background)
    # One OPENDIR of the root, sent by the daemon itself: the first OPENDIR is where the
    # session's table of operations is found (noopendir.py), and with it the kernel
    # opens files itself and large READs are replied from a thread (noopen.py,
    # replies.py). A loader that opens shards by name lists nothing and sends none.
    with contextlib.suppress(OSError):
        await trio.to_thread.run_sync(_open_directory, mountpoint)
    try:
        on_ready()
    except BrokenPipeError:
        # The `bucketfs mount` that forked this daemon is gone (Ctrl-C, killed) and
        # nobody will be told the mount exists: it was cancelled, so undo it.
        log.warning("the bucketfs mount command that started this daemon is gone (interrupted); unmounting")
        pyfuse3.terminate()
