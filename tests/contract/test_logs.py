"""The programs' one logging setup (model_rollout_flags.logs, issue 32): --log-format
text|json and --log-level, from flags or the environment; JSON lines that a log pipeline
parses (time, level, logger, message, extras, the exception as one field); kopf's
per-object records in the same JSON, its Event posting left working."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from model_rollout_contract import defaults
from model_rollout_flags import FlagParser
from model_rollout_flags import logs as logs_module
from model_rollout_flags.logs import (
    TEXT_FORMAT,
    LogSettings,
    add_log_flags,
    fatal,
    log_settings,
    setup_logging,
)

RFC3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    """Each test's setup undone: the root logger's handlers and level, the hooks."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    quiet = {name: logging.getLogger(name).level for name in logs_module.CREDENTIAL_LOGGERS}
    hooks = (sys.excepthook, threading.excepthook, logs_module._current, logs_module._program)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in quiet.items():
        logging.getLogger(name).setLevel(was)
    sys.excepthook, threading.excepthook, logs_module._current, logs_module._program = hooks
    logging.captureWarnings(False)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    """Every line written, each parsed as JSON (a line that does not parse fails)."""
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def json_logging(level: str = "info", **kwargs: Any) -> io.StringIO:
    stream = io.StringIO()
    setup_logging(LogSettings("json", level), "model-test", stream=stream, **kwargs)
    return stream


def test_a_json_line_carries_time_level_logger_message_and_extras() -> None:
    stream = json_logging(fields={"pod": "mlp-0"})
    logging.getLogger("model_server.lifecycle").info(
        "%s now serves %s", "mlp", "v2", extra={"model": "mlp", "version": "v2"}
    )
    [line] = lines(stream)
    assert list(line)[:4] == ["time", "level", "logger", "message"]
    assert RFC3339_UTC.fullmatch(line["time"]), line["time"]
    assert line == {
        "time": line["time"],
        "level": "info",
        "logger": "model_server.lifecycle",
        "message": "mlp now serves v2",
        "pod": "mlp-0",
        "model": "mlp",
        "version": "v2",
    }


def test_an_extra_named_as_a_lines_own_field_never_replaces_it() -> None:
    """A library's ``extra={"level": ...}`` (or time, logger, message, or a field every
    line carries) is kept under ``extra.<name>``: a log pipeline keys on these."""
    stream = json_logging(fields={"pod": "mlp-0"})
    logging.getLogger("lib").warning(
        "it", extra={"level": "fake", "time": "t0", "logger": "other", "pod": "elsewhere"}
    )
    [line] = lines(stream)
    assert (line["level"], line["logger"], line["message"], line["pod"]) == (
        "warning", "lib", "it", "mlp-0",
    )  # fmt: skip
    assert RFC3339_UTC.fullmatch(line["time"]), line["time"]
    assert (line["extra.level"], line["extra.time"], line["extra.logger"]) == (
        "fake", "t0", "other",
    )  # fmt: skip
    assert line["extra.pod"] == "elsewhere"


def test_an_exception_is_one_json_line_with_its_traceback_as_a_field() -> None:
    stream = json_logging()
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        logging.getLogger("model_sidecar").exception("watch cycle failed")
    text = stream.getvalue()
    assert text.count("\n") == 1  # one line, the traceback's newlines escaped
    [line] = lines(stream)
    assert (line["level"], line["message"]) == ("error", "watch cycle failed")
    assert line["exception"].startswith("Traceback (most recent call last):")
    assert line["exception"].endswith("ValueError: bad\nvalue")
    assert "exc_info" not in line and "exc_text" not in line


def test_an_exception_text_set_by_a_filter_is_the_one_written() -> None:
    """The sidecar's redaction rewrites exc_text on the handler's filter: JSON writes
    that text, not the exception formatted anew (which would repeat the credentials)."""
    from model_sidecar.redact import install_log_redaction

    stream = io.StringIO()
    handler = setup_logging(LogSettings("json"), "model-sidecar", stream=stream)
    install_log_redaction([handler])
    try:
        raise OSError("cannot reach https://ops:hunter2@s3.example.com/")
    except OSError:
        logging.getLogger("model_sidecar").exception("fetch failed")
    [line] = lines(stream)
    assert "hunter2" not in stream.getvalue()
    assert line["exception"].endswith("OSError: cannot reach https://***@s3.example.com/")


def test_credentials_in_a_records_extras_are_redacted_too() -> None:
    """A text line never writes the extras; a JSON line writes them all, so the sidecar's
    redaction covers them (and the stack) as it covers the message."""
    from model_sidecar.redact import install_log_redaction

    stream = io.StringIO()
    handler = setup_logging(LogSettings("json"), "model-sidecar", stream=stream)
    install_log_redaction([handler])
    logging.getLogger("botocore").info(
        "sent", extra={"url": "https://ops:hunter2@s3.example.com/b", "count": 2}, stack_info=True
    )
    [line] = lines(stream)
    assert "hunter2" not in stream.getvalue()
    assert (line["url"], line["count"]) == ("https://***@s3.example.com/b", 2)


@pytest.mark.parametrize(
    ("level", "written"),
    [
        ("debug", ["debug", "info", "warning", "error"]),
        ("info", ["info", "warning", "error"]),
        ("warning", ["warning", "error"]),
        ("error", ["error"]),
    ],
)
def test_the_level_is_the_least_severe_written(level: str, written: list[str]) -> None:
    stream = json_logging(level)
    log = logging.getLogger("aiohttp.server")  # a library's logger, as the programs' own
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [line["level"] for line in lines(stream)] == written


def test_debug_never_writes_the_store_libraries_credentials() -> None:
    """At debug botocore writes each request's parameters (STS's AssumeRoleWithWebIdentity:
    IRSA's web identity token) and each answer's body (STS's: the temporary secret
    key). Those libraries stay at info whatever the level; the programs' own records, and
    the libraries' info, are written."""
    stream = json_logging("debug")
    logging.getLogger("botocore.parsers").debug("Response body: <SecretAccessKey>wJal")
    logging.getLogger("botocore.endpoint").debug("params: {'WebIdentityToken': 'eyJ'}")
    logging.getLogger("boto3.resources").debug("credentials")
    logging.getLogger("botocore.credentials").info("Found credentials from IAM Role")
    logging.getLogger("model_sidecar.store").debug("fetching v2")
    assert [(line["logger"], line["level"]) for line in lines(stream)] == [
        ("botocore.credentials", "info"),
        ("model_sidecar.store", "debug"),
    ]


def test_text_is_the_programs_format_as_it_always_was() -> None:
    stream = io.StringIO()
    setup_logging(LogSettings(), "model-operator", stream=stream)
    logging.getLogger("kopf.objects").info("hello %s", "there", extra={"model": "m"})
    assert TEXT_FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s"
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO kopf.objects: hello there\n",
        stream.getvalue(),
    ), stream.getvalue()


def test_a_second_setup_replaces_its_handler_and_keeps_the_others() -> None:
    other = logging.NullHandler()
    logging.getLogger().addHandler(other)
    first = json_logging()
    second = json_logging()
    logging.getLogger("x").warning("once")
    assert first.getvalue() == "" and len(lines(second)) == 1
    assert other in logging.getLogger().handlers


def test_warnings_and_uncaught_exceptions_are_json_lines_too() -> None:
    stream = json_logging()
    warnings.warn("old API", DeprecationWarning, stacklevel=1)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]
    thread = threading.Thread(target=lambda: 1 / 0, name="loader")
    thread.start()
    thread.join()
    warned, uncaught, in_thread = lines(stream)
    assert warned["logger"] == "py.warnings" and "old API" in warned["message"]
    assert (uncaught["logger"], uncaught["level"]) == ("model_test", "critical")
    assert uncaught["exception"].endswith("RuntimeError: boom")
    assert in_thread["message"] == "uncaught exception in thread loader"
    assert in_thread["exception"].endswith("ZeroDivisionError: division by zero")


def test_fatal_is_the_old_text_line_or_a_json_error(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(LogSettings(), "model-server", stream=io.StringIO())
    fatal("--batch-model names 'x', which this server does not serve")
    assert capsys.readouterr().err == (
        "model-server: --batch-model names 'x', which this server does not serve\n"
    )
    stream = io.StringIO()
    setup_logging(LogSettings("json"), "model-server", stream=stream)
    fatal("no API server")
    [line] = lines(stream)
    assert (line["logger"], line["level"], line["message"]) == (
        "model_server",
        "error",
        "no API server",
    )


def _parser() -> FlagParser:
    parser = FlagParser(prog="p", env_prefix="P_")
    add_log_flags(parser)
    return parser


def test_the_flags_default_to_text_and_info_and_are_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert log_settings(_parser().parse_args([])) == LogSettings("text", "info")
    assert LogSettings() == LogSettings(defaults.LOG_FORMAT, defaults.LOG_LEVEL)
    monkeypatch.setenv("P_LOG_FORMAT", "JSON")  # as a person may write it
    monkeypatch.setenv("P_LOG_LEVEL", "warning")
    assert log_settings(_parser().parse_args([])) == LogSettings("json", "warning")
    assert _parser().parse_args(["--log-level", "debug"]).log_level == "debug"
    monkeypatch.setenv("P_LOG_LEVEL", "trace")
    with pytest.raises(SystemExit):
        _parser().parse_args([])
    assert "P_LOG_LEVEL='trace'" in capsys.readouterr().err


def test_kopf_object_records_are_json_with_the_object_and_are_still_posted() -> None:
    """kopf's per-object logger (what its handlers are given) adds the object reference
    and its settings to each record: the JSON line carries the reference as ``object``
    (kopf's own key) and not the settings; kopf's K8sPoster, on the kopf.objects logger,
    still queues the record as an Event when posting is on."""
    import kopf
    from kopf._core.actions.loggers import ObjectLogger
    from kopf._core.engines import posting

    from model_operator.cli import KOPF_HIDE, KOPF_RENAME

    stream = json_logging(rename=KOPF_RENAME, hide=KOPF_HIDE)
    body = kopf.Body(
        {
            "apiVersion": "serving.model-rollout.io/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "mlp", "namespace": "ml", "uid": "u-1"},
        }
    )
    settings = kopf.OperatorSettings()
    settings.posting.enabled = settings.posting.loggers = True  # log lines as Events

    async def log_and_collect() -> list[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        posting.event_queue_var.set(queue)
        posting.event_queue_loop_var.set(asyncio.get_running_loop())
        ObjectLogger(body=body, settings=settings).info("rollout %s started", "v2")
        return [queue.get_nowait() for _ in range(queue.qsize())]

    [event] = asyncio.run(log_and_collect())
    assert (event.type, event.reason, event.message) == ("Normal", "Logging", "rollout v2 started")
    [line] = lines(stream)
    assert (line["logger"], line["message"]) == ("kopf.objects", "rollout v2 started")
    assert line["object"] == {
        "apiVersion": "serving.model-rollout.io/v1alpha1",
        "kind": "ModelDeployment",
        "name": "mlp",
        "uid": "u-1",
        "namespace": "ml",
    }
    assert not {"settings", "k8s_skip", "k8s_ref"} & set(line)
