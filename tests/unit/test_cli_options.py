"""Option values the daemon cannot work with are refused by the CLI, before anything
is mounted or forked: exit 2 and one line naming the option. Also the URL rules and
the help hint. In-process: the mountpoint does not exist, so an option let through
by mistake ends at the mountpoint check (exit 6), never at a mount."""

import errno
import logging
import os
import re

import pytest

from bucketfs import errors
from bucketfs.app import cli, daemon
from bucketfs.config import parse_bucket_url

MISSING_MOUNTPOINT = "/nonexistent/bucketfs-test-mountpoint"


def run_main(capsys, *argv):
    """(exit code, stderr) of `bucketfs ARGV` run in this process."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse exits from inside parse_args
        code = exc.code
    return code, capsys.readouterr().err


def assert_usage_error(capsys, argv, *fragments):
    code, err = run_main(capsys, *argv)
    assert code == errors.EXIT_USAGE, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bucketfs: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize(
    "option, value",
    [
        ("--part-size", "0"),
        ("--part-size", "4K"),
        ("--block-size", "0"),
        ("--block-size", "1K"),
        ("--max-memory", "0"),
        ("--max-memory", "1M"),
        ("--small-file-bytes", "0"),
        ("--readahead-max", "0"),
        ("--cache-size", "0"),
        ("--max-connections", "0"),
        ("--max-connections", "-1"),
        ("--max-connections", "100000"),
        ("--retries", "0"),
        ("--retries", "-3"),
        ("--connect-timeout", "0"),
        ("--connect-timeout", "-1"),
        ("--connect-timeout", "nan"),
        ("--connect-timeout", "inf"),
        ("--read-timeout", "0"),
        ("--read-timeout", "nan"),
        ("--metadata-ttl", "nan"),
        ("--metadata-ttl", "-1"),
        ("--negative-ttl", "nan"),
        ("--negative-ttl", "-5"),
        ("--uid", "-1"),
        ("--uid", str(2**32 - 1)),
        ("--gid", "-1"),
        ("--gid", str(2**32)),
        ("--file-mode", "-1"),
        ("--file-mode", "10000"),
        ("--dir-mode", "17777"),
        ("--file-mode", "9"),
        ("--metrics-port", "0"),
        ("--metrics-port", "65536"),
        ("--metrics-port", "-1"),
        ("--list-ahead", "-1"),
    ],
)
def test_a_value_the_daemon_cannot_use_is_refused(capsys, option, value):
    assert_usage_error(capsys, ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, option, value], option)


@pytest.mark.parametrize(
    "option, value",
    [
        ("--part-size", "64K"),
        ("--block-size", "4K"),
        ("--max-memory", "16M"),
        ("--max-connections", "1"),
        ("--retries", "1"),
        ("--connect-timeout", "0.5"),
        ("--metadata-ttl", "0"),
        ("--uid", "0"),
        ("--gid", str(2**32 - 2)),
        ("--file-mode", "7777"),
        ("--dir-mode", "0"),
        ("--metrics-port", "65535"),
        ("--list-ahead", "0"),
        ("--cache-size", "1M"),
        ("--small-file-bytes", "4K"),
        ("--readahead-max", "64K"),
    ],
)
def test_the_smallest_sensible_values_pass(capsys, option, value):
    # --check: every option check, none of this host's (--allow-other needs root or fuse.conf).
    assert run_main(capsys, "mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--check", "--allow-other", option, value) == (
        errors.EXIT_OK,
        "",
    )


@pytest.mark.parametrize("option, other_id", [("--uid", 4242), ("--gid", 4243)])
def test_files_given_to_another_user_need_allow_other(capsys, option, other_id):
    # Without allow_other FUSE lets only the mounting user in: that owner could not read its own files.
    assert_usage_error(
        capsys, ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, option, str(other_id)], option, "--allow-other"
    )
    mine = str(os.geteuid() if option == "--uid" else os.getegid())
    code, err = run_main(capsys, "mount", "s3://bkt/x", MISSING_MOUNTPOINT, option, mine)  # the mounting user: fine
    assert code in (errors.EXIT_BAD_MOUNTPOINT, errors.EXIT_NO_FUSE), err


@pytest.mark.parametrize("option", ["--part-size", "--block-size", "--small-file-bytes"])
def test_a_buffer_larger_than_half_the_budget_is_refused(capsys, option):
    # A demand larger than the budget is let through alone: RSS would have no bound.
    assert_usage_error(
        capsys,
        ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--max-memory", "16M", option, "9M"],
        option,
        "half of --max-memory",
    )


@pytest.mark.parametrize(
    "url", ["notaurl", "http://", "ftp://host", "http://host:99999", "http://[::1", "http://127.0.0.1:"]
)  # an empty port was let through, then exit 5
def test_an_endpoint_url_that_is_no_url_is_refused(capsys, url):
    assert_usage_error(capsys, ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--endpoint-url", url], "--endpoint-url")


def test_a_region_that_is_no_region_name_is_refused(monkeypatch):
    """botocore's own rule decides (no copy of it in the CLI); the error names the
    option and is a usage error. (test_cli.py checks the same through a real daemon.)"""
    from bucketfs.backends.s3 import S3Backend
    from bucketfs.config import Config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE01")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "example-secret-key-0123456789abcdefghij")
    config = Config(url=parse_bucket_url("s3://bkt/x"), mountpoint="/nonexistent", region="bad!region")
    with pytest.raises(errors.InvalidOption, match="--region 'bad!region'") as raised:
        S3Backend(config)
    assert errors.user_error_for(raised.value, "s3://bkt/x/").exit_code == errors.EXIT_USAGE


def test_the_help_hint_names_the_command(capsys):
    code, err = run_main(capsys)
    assert code == errors.EXIT_USAGE
    assert "(see bucketfs --help)" in err and "bucketfs bucketfs" not in err
    _, err = run_main(capsys, "mount")
    assert "(see bucketfs mount --help)" in err


@pytest.mark.parametrize("url", ["s3://bkt//double", "s3://bkt/a//b", "s3://bkt//", "s3://bkt/a//", "gs://bkt/a/./b"])
def test_an_empty_prefix_component_is_refused_wherever_it_is(url):
    with pytest.raises(ValueError, match="empty, '.' or '..' component"):
        parse_bucket_url(url)


@pytest.mark.parametrize(
    "url, prefix",
    [("s3://bkt", ""), ("s3://bkt/", ""), ("s3://bkt/a", "a/"), ("s3://bkt/a/", "a/"), ("gs://bkt/a/b/", "a/b/")],
)
def test_one_trailing_slash_is_fine(url, prefix):
    assert parse_bucket_url(url).prefix == prefix


def test_errors_of_a_non_s3_answer_name_the_endpoint_and_a_missing_bucket_stays_3():
    not_s3 = errors.user_error_for(errors.NotFound("ListObjectsV2: 404 Not Found"), "s3://bkt/")
    assert not_s3.exit_code == errors.EXIT_ENDPOINT_UNREACHABLE and "is --endpoint-url an S3 endpoint?" in str(not_s3)
    other = errors.user_error_for(errors.BackendError("ListObjectsV2: 501 Unsupported method"), "s3://bkt/")
    assert other.exit_code == errors.EXIT_ENDPOINT_UNREACHABLE
    missing = errors.user_error_for(errors.BucketNotFound("NoSuchBucket"), "s3://bkt/")
    assert missing.exit_code == errors.EXIT_BUCKET_NOT_FOUND
    assert errors.user_error_for(errors.InvalidOption("Invalid endpoint"), "s3://bkt/").exit_code == errors.EXIT_USAGE


def test_an_odd_answer_from_the_default_endpoint_does_not_blame_an_option_the_user_never_gave():
    odd = errors.user_error_for(errors.NotFound("ListObjectsV2: 404 Not Found"), "s3://bkt/", endpoint_given=False)
    assert odd.exit_code == errors.EXIT_ENDPOINT_UNREACHABLE
    assert "--endpoint-url" not in str(odd) and "proxy" in str(odd)


def test_fstab_options_mount8_adds_and_lists_inside_values_are_understood():
    from bucketfs.app.fstab import options_to_argv

    # mount(8) passes `rw` for a `defaults` line; bucketfs sets default_permissions itself.
    assert options_to_argv("rw,default_permissions,_netdev,nofail") == []
    assert options_to_argv("shard_globs=*.tar:*.tgz,max_memory=2G") == [
        "--shard-globs",
        "*.tar,*.tgz",
        "--max-memory",
        "2G",
    ]


def test_allow_other_as_a_user_needs_user_allow_other_in_fuse_conf(tmp_path, monkeypatch):
    # fusermount3 refuses it; a daemonised mount would only have said "mount failed".
    from bucketfs.app import mountpoints

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    conf = tmp_path / "fuse.conf"
    conf.write_text("# user_allow_other\nmount_max = 1000\n")
    with pytest.raises(errors.UserError) as refused:
        mountpoints.check_allow_other_permitted(True, str(conf))
    assert refused.value.exit_code == errors.EXIT_USAGE and "user_allow_other" in str(refused.value)
    mountpoints.check_allow_other_permitted(False, str(conf))  # not asked for: fine
    conf.write_text("user_allow_other  # for bucketfs\n")
    mountpoints.check_allow_other_permitted(True, str(conf))


def _parent_hears(config, report: str):
    """What `bucketfs mount` makes of its daemon's `report` on the readiness pipe."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, report.encode())
    os.close(write_fd)
    return daemon.wait_for_daemon(config, 0, read_fd)


def test_a_daemon_with_nowhere_to_log_says_so_once_mounted(capsys, monkeypatch, tmp_path):
    """No /dev/log (containers): the daemon's log went to a NullHandler, unannounced."""
    import socket

    from bucketfs.config import Config

    monkeypatch.setattr(daemon, "SYSLOG_SOCKET", str(tmp_path / "no-syslog"))
    config = Config(url=parse_bucket_url("s3://bkt/x"), mountpoint="/nonexistent")
    assert _parent_hears(config, "READY\n") == errors.EXIT_OK
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("bucketfs: warning:") and "discarded" in line and "--log-file" in line
    with pytest.raises(errors.UserError):  # a failure stays its one line
        _parent_hears(config, "ERROR 5 s3://bkt/x/: endpoint unreachable\n")
    assert capsys.readouterr().err == ""
    with_log_file = Config(url=config.url, mountpoint=config.mountpoint, log_file=str(tmp_path / "x.log"))
    assert _parent_hears(with_log_file, "READY\n") == errors.EXIT_OK
    assert capsys.readouterr().err == ""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as syslog:
        syslog.bind(str(tmp_path / "no-syslog"))  # now there is one
        assert _parent_hears(config, "READY\n") == errors.EXIT_OK
    assert capsys.readouterr().err == ""


def test_log_file_is_watched_for_rotation(tmp_path):
    import logging.handlers

    from bucketfs.config import Config

    config = Config(url=parse_bucket_url("s3://bkt/x"), mountpoint="/nonexistent", log_file=str(tmp_path / "x.log"))
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level  # pytest's own capture
    try:
        for in_background in (True, False):  # --foreground too
            daemon.setup_logging(config, daemon=in_background)
            (handler,) = root.handlers
            assert isinstance(handler, logging.handlers.WatchedFileHandler)
            handler.close()
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


def test_a_reply_the_kernel_no_longer_waited_for_is_not_logged_as_an_error(tmp_path):
    """At an unmount with READs in flight, or for an interrupted reader, pyfuse3 logs
    its failed reply at ERROR: the log says it at DEBUG only, and other errors stay."""
    from bucketfs.config import Config

    log_path = tmp_path / "x.log"
    config = Config(url=parse_bucket_url("s3://bkt/x"), mountpoint="/nonexistent", log_file=str(log_path))
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level  # pytest's own capture
    try:
        daemon.setup_logging(config, daemon=True)
        pyfuse3_log = logging.getLogger("pyfuse3")
        pyfuse3_log.error("fuse_read(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
        pyfuse3_log.error("fuse_read(): fuse_reply_* failed with %s", os.strerror(errno.EINVAL))
        for handler in root.handlers:
            handler.flush()
            handler.close()
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    logged = log_path.read_text()
    assert os.strerror(errno.ENOENT) not in logged
    assert "ERROR pyfuse3: fuse_read(): fuse_reply_* failed with " + os.strerror(errno.EINVAL) in logged


@pytest.mark.parametrize(
    "options, fragments",
    [
        ("ro,foreground", ["'foreground'", "wait forever"]),  # mount(8) hung
        ("check", ["'check'", "bucketfs mount --check"]),
        ("ro,max_memry=4G", ["unknown fstab option 'max_memry'", "max_memory=4G"]),  # was reported as --max-memry
        ("allow_other=1", ["'allow_other=1'", "without a value"]),
        ("max_memory", ["max_memory=VALUE"]),
    ],
)
def test_fstab_options_are_refused_in_fstab_form(options, fragments):
    from bucketfs.app.fstab import options_to_argv

    with pytest.raises(errors.UserError) as refused:
        options_to_argv(options)
    assert refused.value.exit_code == errors.EXIT_USAGE and "--" not in str(refused.value).split("(")[0]
    for fragment in fragments:
        assert fragment in str(refused.value)


def test_the_fstab_helper_refuses_foreground_in_one_line(capsys):
    from bucketfs.app import fstab

    assert fstab.main(["s3://bkt/x", "/nonexistent", "-o", "ro,foreground"]) == errors.EXIT_USAGE
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("bucketfs: fstab option 'foreground'")


@pytest.mark.parametrize(
    "url, fsname",
    [
        ("s3://bkt/data", "s3://bkt/data"),
        ("s3://bkt/back\\sl", "s3://bkt/back\\134sl"),  # libfuse read '\s' as 's'
        ("s3://bkt/a,b", "s3://bkt/a\\054b"),
        ("s3://bkt/é", "s3://bkt/\\303\\251"),  # pyfuse3 passes options as ASCII
    ],
)
def test_the_fsname_is_the_url_escaped_for_libfuse(url, fsname):
    from bucketfs.app.mount import fuse_option_value

    assert fuse_option_value(url) == fsname


@pytest.mark.parametrize(
    "url, option, value",
    [
        ("gs://bkt/x", "--profile", "p"),
        ("gs://bkt/x", "--region", "us-east-1"),
        ("gs://bkt/x", "--addressing-style", "path"),
        ("s3://bkt/x", "--key-file", "/etc/sa.json"),
    ],
)
def test_an_option_for_the_other_store_is_refused(capsys, url, option, value):
    """It was silently ignored: the mount went ahead with other credentials than asked."""
    assert_usage_error(capsys, ["mount", url, MISSING_MOUNTPOINT, option, value], option)


def test_a_key_file_with_no_sign_request_is_refused(capsys):
    assert_usage_error(
        capsys,
        ["mount", "gs://bkt/x", MISSING_MOUNTPOINT, "--key-file", "/etc/sa.json", "--no-sign-request"],
        "--key-file",
        "--no-sign-request",
    )


def test_metrics_address(capsys):
    assert_usage_error(
        capsys,
        ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--metrics-port", "9101", "--metrics-address", "metrics.example"],
        "--metrics-address",
    )
    assert_usage_error(
        capsys,
        ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--metrics-address", "0.0.0.0"],
        "--metrics-address needs --metrics-port",
    )
    args = cli.build_parser().parse_args(["mount", "s3://bkt/x", "/mnt", "--metrics-port", "9101"])
    assert cli.config_from_args(args).metrics_address == "127.0.0.1"  # this host only, unless asked
    for address, kept in (("0.0.0.0", "0.0.0.0"), ("::", "::"), ("[::1]", "::1")):
        args = cli.build_parser().parse_args(
            ["mount", "s3://bkt/x", "/mnt", "--metrics-port", "9101", "--metrics-address", address]
        )
        assert cli.config_from_args(args).metrics_address == kept


def test_a_negative_ttl_above_the_metadata_ttl_is_refused(capsys):
    """The help said "below --metadata-ttl" and the CLI took any value."""
    assert_usage_error(
        capsys,
        ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--metadata-ttl", "5", "--negative-ttl", "10"],
        "--negative-ttl 10 is above --metadata-ttl 5",
    )
    code, err = run_main(
        capsys, "mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--metadata-ttl", "5", "--negative-ttl", "5"
    )
    assert code in (errors.EXIT_BAD_MOUNTPOINT, errors.EXIT_NO_FUSE), err


@pytest.mark.parametrize(
    "text, size_bytes",
    [
        ("64M", 64 << 20),
        ("64MiB", 64 << 20),
        ("1.5G", 3 << 29),
        ("2T", 2 << 40),
        ("512k", 512 << 10),
        ("1048576", 1 << 20),
        ("4096B", 4096),
    ],
)
def test_sizes(text, size_bytes):
    assert cli.parse_size(text) == size_bytes


@pytest.mark.parametrize(
    "text, fragment", [("1GB", "ambiguous"), ("4kb", "ambiguous"), ("1.5", "not a size"), ("lots", "not a size")]
)
def test_a_size_that_is_ambiguous_or_no_size_is_refused(capsys, text, fragment):
    """'1GB' silently meant 1 GiB."""
    assert_usage_error(
        capsys, ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--max-memory", text], "--max-memory", fragment
    )


def _mount_help() -> str:
    return " ".join(cli.mount_parser().format_help().split())


def test_the_help_says_what_the_parser_enforces():
    text = _mount_help()
    assert "needs --metadata-ttl, and at most its value" in text
    assert "0..1024 (default 16; 0 disables)" in text  # --list-ahead
    assert "owner of every file, 0..4294967294; another user than the one mounting needs --allow-other" in text
    assert "as du counts it" in text  # --cache-size
    assert "KB, MB, GB and TB are refused" in text and "1.5G" in text


def test_every_mount_option_is_in_the_readme_table():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "configuration.md")).read()
    table = readme[readme.index("## Options of `bucketfs mount URL MOUNTPOINT`") : readme.index("## Exit codes")]
    # Each row's first cell names its options (an option mentioned in another row's
    # meaning has no row of its own).
    first_cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {name for cell in first_cells for name in re.findall(r"`(--[a-z-]+)", cell)}
    assert documented == set(cli.mount_options())
    assert "KB, MB, GB and TB are refused" in " ".join(table.replace("`", "").split())  # sizes, as the help says


def test_check_refuses_a_region_the_daemon_would_refuse(capsys):
    """The install-time check (install-systemd.sh runs it) catches what the SDK refuses."""
    assert_usage_error(
        capsys, ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--check", "--region", "bad!region"], "--region"
    )
    assert run_main(capsys, "mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--check", "--region", "eu-west-1") == (
        errors.EXIT_OK,
        "",
    )


def test_check_validates_without_mounting(capsys):
    assert run_main(capsys, "mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--check", "--max-memory", "2G") == (
        errors.EXIT_OK,
        "",
    )
    assert_usage_error(
        capsys, ["mount", "s3://bkt/x", MISSING_MOUNTPOINT, "--check", "--max-memry", "2G"], "--max-memry"
    )
    assert_usage_error(capsys, ["mount", "s3:/bkt/x", MISSING_MOUNTPOINT, "--check"], "not a bucket URL")


def test_a_cache_dir_that_is_a_file_says_so(capsys, monkeypatch, tmp_path):
    """It said 'File exists' (of a makedirs)."""
    from bucketfs.app import mountpoints

    monkeypatch.setattr(mountpoints, "check_fuse_available", lambda: None)
    (tmp_path / "mp").mkdir()
    (tmp_path / "afile").write_text("x")
    code, err = run_main(capsys, "mount", "s3://bkt/x", str(tmp_path / "mp"), "--cache-dir", str(tmp_path / "afile"))
    assert (
        code == errors.EXIT_BAD_CACHE_DIR and err == f"bucketfs: --cache-dir {tmp_path / 'afile'} is not a directory\n"
    )


def test_the_stats_summary_shows_the_store_and_labels_blocks():
    from bucketfs.metrics import _Collector, format_stats

    snapshot = {
        "backend.requests.get": 10,
        "backend.retries": 8,
        "backend.failures.TransientError": 2,
        "errors.EIO": 2,
        "cache.hits": 5,
        "cache.misses": 20,
        "cache.shared_misses": 3,
        "disk_cache.capacity_bytes": 1 << 30,
        "disk_cache.skipped_stores": 4,
    }
    lines = {line.split("  ")[0]: line for line in format_stats(snapshot).splitlines()}
    assert lines["store"] == "store         retries 8; failed after retries: TransientError 2"  # it showed neither
    snapshot["backend.corrupt_bodies"] = 3
    assert format_stats(snapshot).splitlines()[1] == (
        "store         retries 8 (3 for bytes not matching the store's "
        "checksum); failed after retries: TransientError 2"
    )
    # The misses Prometheus counts (bucketfs_cache_misses), apart from blocks that joined a fetch.
    assert (
        "blocks: 5 hits, 20 misses (fetched, one GET per run of them), 3 joined a fetch in flight"
        in lines["block cache"]
    )
    assert "in 4 fetches" in lines["disk cache"]
    metrics = {family.name: family for family in _Collector(lambda: snapshot).collect()}
    assert metrics["bucketfs_disk_cache_skipped_stores"].samples[0].value == 4
    assert metrics["bucketfs_cache_misses"].samples[0].value == 20
