"""Each option of `bucketfs mount` is written once, on its Config field: `--help`, the
fstab helper, docs/configuration.md and the checks all come from it, and a Config built
in code is checked like one built from argv (same rules, same one-line reasons)."""

import ast
import dataclasses
import os
import pathlib
import re

import pytest

from bucketfs import errors
from bucketfs.app import cli, configdoc, fstab
from bucketfs.config import Config, options, parse_bucket_url

REPO = pathlib.Path(__file__).resolve().parents[2]
URL = "s3://bkt/x"
MISSING_MOUNTPOINT = "/nonexistent/bucketfs-test-mountpoint"


def make(**fields) -> Config:
    return Config(url=parse_bucket_url(fields.pop("url", URL)), mountpoint="/nonexistent", **fields)


def _plain(text: str) -> str:
    return text.replace("`", "").replace("\\|", "|").strip()


def help_defaults(monkeypatch) -> dict:
    """{option: its default} as `bucketfs mount --help` prints it."""
    monkeypatch.setenv("COLUMNS", "10000")  # one line per option's help
    blocks, current = {}, None
    for line in cli.mount_parser().format_help().splitlines():
        m = re.match(r"^  ((?:-\w, )?--[a-z-]+)(.*)$", line)
        if m:
            current = m.group(1).split(", ")[-1]
            blocks[current] = m.group(2)
        elif current and line.startswith("   "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    del blocks["--help"]
    defaults = {}
    for name, text in blocks.items():
        found = re.search(r"\(default:? (.*)\)$", text.strip())
        assert found, f"{name}: no default in its help: {text}"
        defaults[name] = found.group(1)
    return defaults


def doc_table(text: str, start: str, end: str) -> dict:
    """{option: default cell} of the tables between the headings `start` and `end`."""
    section = text[text.index(start) : text.index(end)]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        names = re.findall(r"`(--[a-z-]+)", cells[0])
        defaults = [cells[1]] if len(names) == 1 else cells[1].split(", ")
        assert len(defaults) == len(names), line
        rows.update((name, _plain(default)) for name, default in zip(names, defaults, strict=True))
    return rows


def docs_defaults() -> dict:
    text = (REPO / "docs" / "configuration.md").read_text()
    return doc_table(text, "## Options of `bucketfs mount URL MOUNTPOINT`", "## Exit codes")


def test_configuration_md_is_what_the_generator_writes():
    text = (REPO / "docs" / "configuration.md").read_text()
    assert text == configdoc.configuration_markdown(), (
        "docs/configuration.md is stale: python3 -m bucketfs.app.configdoc"
    )
    assert configdoc.main(["--check"]) == 0


def test_help_the_fstab_helper_and_the_docs_name_the_same_options_with_the_same_defaults(monkeypatch):
    in_help = help_defaults(monkeypatch)
    in_docs = docs_defaults()
    assert set(in_help) == set(in_docs)
    for name, default in in_docs.items():
        # (a help may say more after the default: "(default 16; 0 disables)")
        assert in_help[name] == default or in_help[name].startswith(default + ";"), (name, in_help[name], default)

    accepted, refused = set(), set()
    for name in in_help:
        key = name[2:].replace("-", "_")
        try:
            argv = fstab.options_to_argv(f"ro,{key}=1" if cli.mount_options()[name] else f"ro,{key}")
        except errors.UserError:
            refused.add(name)
            continue
        assert argv[0] == name
        accepted.add(name)
    assert refused == {"--foreground", "--check"}  # (mount(8) waits for its helper to return)
    assert accepted | refused == set(in_help)
    with pytest.raises(errors.UserError, match="unknown fstab option"):
        fstab.options_to_argv("kernel_dir_cachе=off")  # (a Cyrillic e: no such option)


def test_the_defaults_shown_are_the_defaults_a_mount_gets(monkeypatch):
    in_help = help_defaults(monkeypatch)
    for field, opt in options():
        if opt.default_text is None:
            assert in_help[opt.flag].startswith(opt.show(field.default)), opt.flag
    # argv without options, and an fstab line of generic options only, give Config's own defaults.
    assert fstab.options_to_argv("ro,_netdev,nofail,x-systemd.automount") == []
    from_argv = cli.config_from_args(cli.build_parser().parse_args(["mount", URL, "/mnt/data"]))
    assert from_argv == Config(url=parse_bucket_url(URL), source=URL, mountpoint=os.path.realpath("/mnt/data"))


def test_the_readme_table_agrees_with_the_docs():
    readme = (REPO / "README.md").read_text()
    table = doc_table(readme, "## Options that matter", "## Consistency")
    assert table, "README.md has no options table"
    in_docs = docs_defaults()
    for name, default in table.items():
        assert name in in_docs, f"README.md names {name}, which bucketfs mount does not have"
        assert default == in_docs[name], (name, default, in_docs[name])


# Every value `test_cli_options.py` shows the CLI refusing, given to Config in code.
REFUSED_VALUES = [
    ("--part-size", "0"),
    ("--part-size", "4K"),
    ("--block-size", "1K"),
    ("--max-memory", "1M"),
    ("--small-file-bytes", "0"),
    ("--readahead-max", "0"),
    ("--cache-size", "0"),
    ("--max-connections", "0"),
    ("--max-connections", "100000"),
    ("--retries", "0"),
    ("--connect-timeout", "0"),
    ("--connect-timeout", "nan"),
    ("--connect-timeout", "inf"),
    ("--read-timeout", "nan"),
    ("--metadata-ttl", "nan"),
    ("--metadata-ttl", "-1"),
    ("--negative-ttl", "-5"),
    ("--uid", "-1"),
    ("--gid", str(2**32)),
    ("--file-mode", "10000"),
    ("--dir-mode", "17777"),
    ("--metrics-port", "0"),
    ("--metrics-port", "65536"),
    ("--list-ahead", "-1"),
    ("--endpoint-url", "ftp://host"),
    ("--endpoint-url", "http://127.0.0.1:"),
    ("--metrics-address", "metrics.example"),
    ("--kernel-dir-cache", "sometimes"),
    ("--log-level", "LOUD"),
]


def run_main(capsys, *argv):
    """(exit code, stderr lines) of `bucketfs ARGV` run in this process."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse exits from inside parse_args
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("flag, text", REFUSED_VALUES)
def test_a_config_built_in_code_refuses_what_the_cli_refuses(capsys, flag, text):
    code, lines = run_main(capsys, "mount", URL, MISSING_MOUNTPOINT, flag, text)
    assert code == errors.EXIT_USAGE and len(lines) == 1 and flag in lines[0]
    field, opt = next((f, o) for f, o in options() if o.flag == flag)
    value = cli._PARSERS.get(opt.kind, lambda text, opt: text)(text, opt)  # parsed, not checked
    with pytest.raises(ValueError) as refused:
        make(**{field.name: value})
    assert str(refused.value).startswith(f"{flag} ") and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "argv, fields",
    [
        (["--metadata-ttl", "5", "--negative-ttl", "10"], dict(metadata_ttl_s=5.0, negative_ttl_s=10.0)),
        (["--negative-ttl", "10"], dict(negative_ttl_s=10.0)),
        (["--max-memory", "16M", "--part-size", "9M"], dict(max_memory_bytes=16 << 20, part_size_bytes=9 << 20)),
        (
            ["--max-memory", "16M", "--small-file-bytes", "8388609"],
            dict(max_memory_bytes=16 << 20, small_file_bytes=(8 << 20) + 1),
        ),
        (["--key-file", "/k.json"], dict(key_file="/k.json")),
        (
            ["--key-file", "/k.json", "--no-sign-request"],
            dict(url="gs://bkt/x", key_file="/k.json", no_sign_request=True),
        ),
        (["--metrics-address", "0.0.0.0"], dict(metrics_address="0.0.0.0")),
        (["--uid", "4242"], dict(uid=4242)),
    ],
)
def test_cross_field_rules_are_configs_own_with_the_clis_message(capsys, argv, fields):
    """The CLI prints exactly what Config raises (the CLI has no rules of its own)."""
    url = fields.pop("url", URL)
    code, lines = run_main(capsys, "mount", url, MISSING_MOUNTPOINT, *argv)
    with pytest.raises(ValueError) as refused:
        Config(url=parse_bucket_url(url), source=url, mountpoint="/nonexistent", **fields)
    assert (code, lines) == (errors.EXIT_USAGE, [f"bucketfs: {refused.value}"])


def test_an_option_for_the_other_store_is_refused_in_code_too():
    with pytest.raises(ValueError, match="--profile is an S3 option and gs://bkt/x/ is a GCS URL"):
        make(url="gs://bkt/x", profile="p")
    make(url="gs://bkt/x", key_file="/k.json")  # fine


def test_values_that_follow_others():
    assert make(part_size_bytes=32 << 20, readahead_max_bytes=1 << 20).readahead_max_bytes == 32 << 20
    assert make(metadata_ttl_s=60).negative_ttl_s == float("inf")  # the metadata TTL
    assert make(metadata_ttl_s=60, negative_ttl_s=5).negative_ttl_s == 5
    assert make().path_style is False and make(endpoint_url="http://127.0.0.1:9000").path_style is True
    assert make(endpoint_url="http://127.0.0.1:9000", addressing_style="virtual").path_style is False
    assert make(shard_globs=["*.tar"]).shard_globs == ("*.tar",)
    # dataclasses.replace checks again: a change that breaks a rule is refused.
    with pytest.raises(ValueError, match="--negative-ttl needs --metadata-ttl"):
        dataclasses.replace(make(metadata_ttl_s=60, negative_ttl_s=5), metadata_ttl_s=float("inf"))


def test_component_constructors_take_no_defaults_that_mirror_config():
    """A default of its own would be a second, silently diverging, source of truth."""
    config_names = {field.name for field in dataclasses.fields(Config)}
    found = []
    for path in (REPO / "bucketfs").rglob("*.py"):
        if path.relative_to(REPO / "bucketfs").parts[0] not in ("core", "backends", "diskcache", "fuse"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args
                with_defaults = args[len(args) - len(node.args.defaults) :] + [
                    a for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True) if d is not None
                ]
                found += [f"{path.name}:{node.lineno} {a.arg}" for a in with_defaults if a.arg in config_names]
    assert not found
    from bucketfs.backends.calls import RetryPolicy

    with pytest.raises(TypeError):
        RetryPolicy()  # type: ignore[call-arg]  # the Config's retry_* fields, always given
