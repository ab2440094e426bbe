"""What the command line says when a command fails: one line a person can act on.

Owns: :class:`UsageError` (a bad argument value, said by the command), :func:`explain` (known
failures of the world outside: no credentials, an endpoint that refuses or does not answer,
plain HTTP without ``AWS_ALLOW_HTTP``, a bucket or prefix that does not exist) and the exit
statuses. Never: hides an unknown failure (its traceback is printed: it is a bug to report).
"""

from __future__ import annotations

import re

__all__ = ["EXIT_INTERRUPTED", "EXIT_TERMINATED", "EXIT_USAGE", "UsageError", "explain"]

EXIT_USAGE = 2  # a bad argument, or a known failure the user can fix
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # SIGTERM: 128 + SIGTERM


class UsageError(Exception):
    """A command's argument has a value it cannot run with; the message names the flag."""


_URL = re.compile(r"\b[A-Z]+ (https?://\S+)")
# A missing bucket: S3's error code, Azure's, and GCS's message (which has no code)
_NO_BUCKET = re.compile(r"NoSuchBucket|ContainerNotFound|(bucket|container) does not exist")


def _endpoint(text: str) -> str:
    """The scheme, host and port of the first request a store error names, or ``?``."""
    found = _URL.search(text)
    if found is None:
        return "?"
    url = found.group(1)
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def explain(exc: BaseException) -> str | None:
    """One line saying what went wrong and what to do, for a failure a user can fix; None for
    anything else (a bug: show its traceback)."""
    text = str(exc)
    if isinstance(exc, UsageError):
        return str(exc)
    metadata = "169.254.169.254" in text or "metadata.google.internal" in text
    if "S3" in text and (metadata or "api/token" in text or "NoCredentialProviders" in text):
        return (
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE), or AWS_SKIP_SIGNATURE=true for a public bucket"
        )
    if "GCS" in text and metadata:
        return (
            "no Google Cloud credentials found: set GOOGLE_APPLICATION_CREDENTIALS to a "
            "service account's key file (or GOOGLE_SERVICE_ACCOUNT_KEY)"
        )
    if "builder error" in text and "http://" in text:
        return (
            f"the endpoint {_endpoint(text)} is plain HTTP: set AWS_ALLOW_HTTP=true to allow "
            "it (or use https://)"
        )
    if "error sending request" in text or "Connection refused" in text:
        return (
            f"cannot reach {_endpoint(text)}: is the server up, and is the endpoint "
            "(AWS_ENDPOINT_URL) right?"
        )
    if _NO_BUCKET.search(text):
        return f"the bucket does not exist: {text.splitlines()[0][:200]}"
    if type(exc).__name__ == "NotFoundError" and type(exc).__module__.startswith("obstore"):
        # An object listed, then gone (S3's NoSuchKey also says "does not exist": it was
        # taken for a missing bucket, found by review): the note names it
        notes = [n for n in getattr(exc, "__notes__", ()) if n.startswith("aioloader: no ")]
        return notes[0].removeprefix("aioloader: ") if notes else text.splitlines()[0][:300]
    if isinstance(exc, ValueError) and text.startswith("no objects under"):
        return f"{text}: check the prefix (and --url's trailing slash)"
    if isinstance(exc, (PermissionError, FileNotFoundError)):
        return str(exc)
    if type(exc).__module__.startswith("obstore"):  # the store said no: its first line says why
        return f"the store failed: {text.splitlines()[0][:300]}"
    return None
