"""The command line as a person meets it: help, version, the demo, and every failure said in one
line with the fix named and exit status 2; Ctrl-C and SIGTERM stop it cleanly (130, 143), the
demo's temporary folder removed, no traceback from the command or its workers."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aioloader._cli.command import main
from aioloader._cli.errors import UsageError, explain

ROOT = Path(__file__).parents[2]


def aioloader(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioloader", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def test_help_lists_the_commands_and_version_names_the_versions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--version"])
    assert re.fullmatch(r"aioloader \S+ \(torch \S+, Python \S+\)\n", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    shown = capsys.readouterr().out
    for flag, default in [("--samples", "4096"), ("--epochs", "3"), ("--batch-size", "64")]:
        assert flag in shown and f"(default: {default})" in shown


def test_the_demo_trains_and_prints_statistics() -> None:
    done = aioloader("demo", "--samples", "512", "--epochs", "2")
    assert done.returncode == 0, done.stderr
    assert "samples/s" in done.stdout
    assert "LoaderStatistics: 16 batches, 1,024 samples" in done.stdout
    assert "verdict: " in done.stdout
    assert "epoch 2/2" in done.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["demo", "--batch-size", "0"], "argument --batch-size: must be 1 or more, got 0"),
        (["demo", "--epochs", "0"], "argument --epochs: must be 1 or more, got 0"),
        (["demo", "--samples", "many"], "argument --samples: must be a whole number"),
        (["nope"], "invalid choice: 'nope'"),
    ],
)
def test_a_bad_argument_is_one_line_and_status_2(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (argparse's own exit; the demo's test runs ``python -m aioloader``)."""
    with pytest.raises(SystemExit) as done:
        main(args)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err
    assert "--help" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_device_this_machine_lacks_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"aioloader demo: --device cuda: this machine has no CUDA device (torch "
        f"{torch.__version__}); leave --device out to train on the CPU\n"
    )


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STORE = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


def test_an_endpoint_that_refuses_or_is_plain_http_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    for name, value in {**STORE, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    assert main(["demo", "--url", "s3://nope/"]) == 2
    plain = capsys.readouterr().err
    assert plain == (
        f"aioloader demo: the endpoint {endpoint} is plain HTTP: set AWS_ALLOW_HTTP=true to "
        "allow it (or use https://)\n"
    )
    assert main(["demo", "--url", "s3://nope/", "--verbose"]) == 2
    verbose = capsys.readouterr().err
    assert "Traceback" in verbose and verbose.endswith(plain)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert main(["demo", "--url", "s3://nope/"]) == 2
    assert capsys.readouterr().err == (
        f"aioloader demo: cannot reach {endpoint}: is the server up, and is the endpoint "
        "(AWS_ENDPOINT_URL) right?\n"
    )


def test_a_url_that_is_no_store_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--url", "/no/such/folder"]) == 2
    assert capsys.readouterr().err == (
        "aioloader demo: --url /no/such/folder: give a store URL: s3://bucket/prefix/, "
        "gs://..., az://..., file:///absolute/path/\n"
    )
    assert main(["demo", "--url", "file:///no/such/folder/"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aioloader demo: the store failed: ") and err.count("\n") == 1


def test_a_reader_that_goes_away_ends_the_demo_quietly() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "aioloader", "demo", "--samples", "256", "--epochs", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    ) as demo:
        assert demo.stdout is not None and demo.stderr is not None
        demo.stdout.readline()
        demo.stdout.close()  # as `| head -1` does
        err = demo.stderr.read()
        assert demo.wait(timeout=120) == 141
    assert "Traceback" not in err


def test_known_failures_are_explained_and_unknown_ones_are_not() -> None:
    imds = RuntimeError(
        "Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token in "
        "921µs - Server returned non-2xx status code: 403 Forbidden"
    )
    assert "no AWS credentials found" in (explain(imds) or "")
    assert explain(KeyError("x")) is None  # a bug: its traceback is shown, not a sentence


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", ["0", "2"])
@pytest.mark.parametrize(
    ("sig", "status", "word"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
)
def test_ctrl_c_and_sigterm_stop_the_demo_cleanly(
    workers: str, sig: signal.Signals, status: int, word: str
) -> None:
    """The signal goes to the whole process group, as a terminal sends Ctrl-C."""
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aioloader",
            "demo",
            "--samples",
            "3000",
            "--epochs",
            "500",
            "--workers",
            workers,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    assert demo.stdout is not None
    first = demo.stdout.readline()  # the folder is written and the loader starts
    folder = re.search(r"/\S+aioloader-demo-\w+", first)
    assert folder is not None, first
    time.sleep(1.0)  # into the epochs
    os.killpg(demo.pid, sig)
    time.sleep(0.05)
    os.killpg(demo.pid, sig)  # impatient: a second one must not cut the cleanup short
    rest, _ = demo.communicate(timeout=60)
    assert demo.returncode == status, first + rest
    assert rest.splitlines()[-1] == f"aioloader demo: {word}", rest
    assert "Traceback" not in rest
    assert not Path(folder.group(0)).exists()


def test_a_sample_whose_label_is_no_demo_class_is_a_usage_error() -> None:
    # A label byte of 9 reached the loss as "Target 9 is out of bounds", with a traceback
    from aioloader._cli.demo import decode

    with pytest.raises(UsageError, match="label byte is 9, not a demo sample's"):
        decode(bytes([9]) + bytes(3 * 16 * 16))
    assert decode(bytes([3]) + bytes(3 * 16 * 16))[1] == 3
