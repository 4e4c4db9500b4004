"""`sluice batch`: send a JSONL file through the Batches API, follow it, fetch its results.

The client side of `/v1/files` and `/v1/batches`. It talks to a running Sluice (or any
OpenAI-compatible server) over HTTP through the official openai SDK, so it sees exactly
what an SDK user sees. Other commands reuse it: `connected(url, api_key)` gives a client
and turns its errors into one line and an exit code; `submit_and_wait` and `download` are
plain functions of that client. Polling hands each Batch to a callback; `ProgressBar` is
the one the CLI passes (rich, on stderr, so `--json` on stdout stays parseable).

Exit codes: 0 done (`--wait`: the batch completed); 1 the batch ended otherwise, or has
no output to download yet; 2 the command failed (bad input, an error answered by the
server, no connection); 130 Ctrl-C stopped waiting (the batch keeps running).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import json
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, cast, get_args

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from sluice.cli_common import emit_json, served_key

if TYPE_CHECKING:
    # imported when a command runs: `sluice serve` and `--help` need not load the SDK
    import openai
    from openai.types import Batch

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
ENDPOINTS: tuple[str, ...] = get_args(Endpoint)
TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
DEFAULT_URL = "http://127.0.0.1:8000/v1"
POLL_INTERVAL_S = 1.0

batch_app = typer.Typer(
    help="Submit JSONL files to the Batches API, follow them, download their results.",
    no_args_is_help=True,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="The SDK object as JSON on stdout.")]
UrlOption = Annotated[
    str, typer.Option("--url", envvar="SLUICE_URL", help="The server's /v1 base URL.")
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar=["SLUICE_API_KEY", "OPENAI_API_KEY"],
        help="Bearer key (`sluice serve` prints the one it accepts).",
        show_default=False,
    ),
]
BatchId = Annotated[str, typer.Argument(help="The batch id (batch_…).")]


def register(app: typer.Typer) -> None:
    """Add `batch {submit,status,list,cancel,download}` to the `sluice` app."""
    app.add_typer(batch_app, name="batch")


class BatchInputError(Exception):
    """The command's own input is wrong (a flag, the JSONL file); nothing was sent."""


class NoOutputYet(Exception):
    """The batch has no output file to download: still running, or it failed whole."""


class StoppedWaiting(Exception):
    """Ctrl-C while waiting; the batch keeps running on the server."""

    def __init__(self, batch_id: str) -> None:
        super().__init__(batch_id)
        self.batch_id = batch_id


# -- pure parts: input, figures, exit codes ---------------------------------------------


def parse_metadata(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` flags as the batch's metadata; the server enforces OpenAI's limits."""
    metadata: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BatchInputError(f"--metadata takes KEY=VALUE, got {pair!r}")
        if key in metadata:
            raise BatchInputError(f"--metadata {key} is given twice")
        metadata[key] = value
    return metadata


def check_endpoint(value: str, where: str) -> Endpoint:
    if value not in ENDPOINTS:
        raise BatchInputError(f"{where} is {value!r}; batches take one of {', '.join(ENDPOINTS)}")
    return cast(Endpoint, value)


def detect_endpoint(path: Path) -> Endpoint:
    """The `url` of the file's first request (every line of a batch names the same one)."""
    with path.open("rb") as fh:
        first = fh.readline()
    if not first.strip():
        raise BatchInputError(f"{path}: line 1 is empty; a batch file holds one request a line")
    try:
        request = json.loads(first)
    except ValueError as exc:
        raise BatchInputError(f"{path}: line 1 is not JSON ({exc})") from exc
    url = request.get("url") if isinstance(request, dict) else None
    if not isinstance(url, str):
        raise BatchInputError(f'{path}: line 1 has no "url"; pass --endpoint')
    return check_endpoint(url, f'{path} line 1 "url"')


def exit_code(status: str) -> int:
    """What `submit --wait` exits with once the batch ended."""
    return 0 if status == "completed" else 1


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """What a progress line shows, from one Batch and the time now."""

    status: str
    done: int  # lines answered, succeeded or failed
    total: int  # 0 until the server has counted the file's lines
    failed: int
    output_tokens_per_s: float | None
    eta_s: float | None

    @classmethod
    def of(cls, batch: Batch, now_s: float) -> BatchProgress:
        counts = batch.request_counts
        total, failed = (counts.total, counts.failed) if counts else (0, 0)
        done = counts.completed + failed if counts else 0
        running_s = _running_s(batch, now_s)
        tokens = batch.usage.output_tokens if batch.usage is not None else None
        rate = tokens / running_s if tokens is not None and running_s else None
        eta = None
        if batch.status == "in_progress" and running_s and 0 < done < total:
            eta = running_s * (total - done) / done
        return cls(batch.status, done, total, failed, rate, eta)

    def describe(self) -> str:
        """The figures after the bar: `1 failed · 42.0 tok/s · ETA 0:01:05`."""
        parts = [f"{self.failed} failed"]
        if self.output_tokens_per_s is not None:
            parts.append(f"{self.output_tokens_per_s:,.1f} tok/s")
        if self.eta_s is not None:
            parts.append(f"ETA {_clock(self.eta_s)}")
        return " · ".join(parts)


def _running_s(batch: Batch, now_s: float) -> float | None:
    """Seconds since the batch started running, up to its end once it ended."""
    if batch.in_progress_at is None:
        return None
    ends = (
        batch.finalizing_at,
        batch.completed_at,
        batch.failed_at,
        batch.expired_at,
        batch.cancelled_at,
    )
    end_s = next((t for t in ends if t is not None), now_s)
    return max(end_s - batch.in_progress_at, 0) or None


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{secs:02}"


# -- talking to the server -----------------------------------------------------------------


def make_client(url: str, api_key: str | None) -> openai.OpenAI:
    """The SDK's client for `url`; its retries (2, with backoff) ride out a blip in polling.

    With no key given, a server on this machine is sent the key `sluice serve` keeps in
    its data dir; a remote one never is."""
    if not api_key and _is_loopback(url):
        api_key = served_key()
    if not api_key:
        raise BatchInputError(
            "no API key: pass --api-key or set SLUICE_API_KEY or OPENAI_API_KEY (a server"
            " on this machine: the key `sluice serve` keeps in $SLUICE_DATA_DIR is used)"
        )
    try:
        import openai
    except ImportError as exc:
        raise BatchInputError("sluice batch needs the openai package: pip install openai") from exc
    return openai.OpenAI(base_url=url, api_key=api_key)


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextmanager
def connected(url: str, api_key: str | None) -> Iterator[openai.OpenAI]:
    """A client for the server at `url`; what goes wrong inside exits with one line."""
    try:
        with make_client(url, api_key) as client:
            yield client
    except BatchInputError as exc:
        raise _fail(str(exc), 2) from None
    except NoOutputYet as exc:
        raise _fail(str(exc), 1) from None
    except StoppedWaiting as stopped:
        typer.echo(
            f"stopped waiting; batch {stopped.batch_id} keeps running.\n"
            f"  follow it: sluice batch status {stopped.batch_id}\n"
            f"  stop it:   sluice batch cancel {stopped.batch_id}",
            err=True,
        )
        raise typer.Exit(130) from None
    except Exception as exc:
        import openai

        if isinstance(exc, openai.APIStatusError):
            raise _fail(f"{exc.status_code} {server_message(exc)}", 2) from None
        if isinstance(exc, openai.APIConnectionError):
            raise _fail(f"cannot reach {url}: {exc}", 2) from None
        raise


def server_message(exc: openai.APIStatusError) -> str:
    """The `error.message` of the server's OpenAI error object, on one line."""
    error = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return " ".join(str(message or exc.message).split())


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def submit(
    client: openai.OpenAI,
    path: Path,
    endpoint: str | None = None,
    *,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
) -> Batch:
    """Upload `path` (purpose `batch`) and create a batch of it; the endpoint defaults to
    the url of its first line."""
    import openai

    chosen = check_endpoint(endpoint, "--endpoint") if endpoint else detect_endpoint(path)
    with path.open("rb") as fh:
        uploaded = client.files.create(file=(path.name, fh), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint=chosen,
        # the SDK types OpenAI's only window; a server may offer others
        completion_window=cast(Literal["24h"], completion_window),
        metadata=metadata or openai.omit,
    )


def wait(
    retrieve: Callable[[str], Batch],
    batch_id: str,
    *,
    on_progress: Callable[[Batch], None] | None = None,
    poll_interval_s: float = POLL_INTERVAL_S,
    sleep: Callable[[float], None] = time.sleep,
) -> Batch:
    """Retrieve the batch until it ends, each Batch to `on_progress`; the last one.

    Ctrl-C raises StoppedWaiting: only the waiting stops, the batch keeps running.
    """
    try:
        while True:
            batch = retrieve(batch_id)
            if on_progress is not None:
                on_progress(batch)
            if batch.status in TERMINAL_STATUSES:
                return batch
            sleep(poll_interval_s)
    except KeyboardInterrupt:
        raise StoppedWaiting(batch_id) from None


def submit_and_wait(
    client: openai.OpenAI,
    path: Path,
    endpoint: str | None = None,
    *,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
    on_progress: Callable[[Batch], None] | None = None,
    poll_interval_s: float = POLL_INTERVAL_S,
) -> Batch:
    """`submit`, then `wait` until the batch ends; the final Batch."""
    batch = submit(client, path, endpoint, completion_window=completion_window, metadata=metadata)
    if on_progress is not None:
        on_progress(batch)
    return wait(
        client.batches.retrieve, batch.id, on_progress=on_progress, poll_interval_s=poll_interval_s
    )


@dataclass(frozen=True, slots=True)
class Downloaded:
    batch_id: str
    status: str
    output: Path
    output_lines: int
    errors: Path | None
    errors_lines: int


def download(
    client: openai.OpenAI, batch: Batch, output: Path, errors: Path | None = None
) -> Downloaded:
    """Write the batch's output file to `output` (and its error file to `errors`).

    A batch that ended without one of them had no line of that kind: its file is written
    empty. A batch still running, or failed whole, raises NoOutputYet.
    """
    if batch.output_file_id is None:
        if batch.status == "failed":
            reasons = [e.message for e in (batch.errors.data or [])] if batch.errors else []
            why = f" ({'; '.join(m for m in reasons if m)})" if any(reasons) else ""
            raise NoOutputYet(f"batch {batch.id} failed{why}: it has no output file")
        if batch.status not in TERMINAL_STATUSES:
            figures = BatchProgress.of(batch, time.time())
            raise NoOutputYet(
                f"batch {batch.id} is {batch.status} ({figures.done}/{figures.total} lines"
                f" done): no output file yet; follow it with `sluice batch status {batch.id}`"
            )
    output_lines = _write_file(client, batch.output_file_id, output)
    errors_lines = _write_file(client, batch.error_file_id, errors) if errors else 0
    return Downloaded(batch.id, batch.status, output, output_lines, errors, errors_lines)


def _write_file(client: openai.OpenAI, file_id: str | None, path: Path) -> int:
    """Stream a file's content to `path` (via a `.part` file, so a cut never leaves a
    short file under the real name); its line count."""
    part = path.with_name(path.name + ".part")
    lines, last = 0, b"\n"
    with part.open("wb") as out:
        if file_id is not None:
            with client.files.with_streaming_response.content(file_id) as response:
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    lines += chunk.count(b"\n")
                    last = chunk[-1:] or last
    part.replace(path)
    return lines + (last != b"\n")


# -- rendering -----------------------------------------------------------------------------


class ProgressBar:
    """A rich progress bar on stderr, fed one Batch per poll (an `on_progress` callback)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            console=Console(stderr=True),
        )
        self._task = self._progress.add_task("submitting", total=None, detail="")

    def __enter__(self) -> ProgressBar:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def __call__(self, batch: Batch) -> None:
        figures = BatchProgress.of(batch, self._clock())
        self._progress.update(
            self._task,
            description=f"{batch.id} {figures.status}",
            completed=figures.done,
            total=figures.total or None,
            detail=figures.describe(),
        )


def _when(unix_s: int | None) -> str:
    if unix_s is None:
        return "-"
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def render_status(batch: Batch, now_s: float) -> str:
    figures = BatchProgress.of(batch, now_s)
    lines = [
        f"{batch.id}  {batch.status}  {batch.endpoint}",
        f"lines: {figures.done}/{figures.total} done, {figures.describe()}",
        f"created {_when(batch.created_at)}, ended {_when(_ended_at(batch))}",
        f"output file: {batch.output_file_id or '-'}  error file: {batch.error_file_id or '-'}",
    ]
    if batch.errors and batch.errors.data:
        lines += [f"error: line {e.line or '-'}: {e.message}" for e in batch.errors.data]
    if batch.metadata:
        lines.append("metadata: " + " ".join(f"{k}={v}" for k, v in batch.metadata.items()))
    return "\n".join(lines)


def _ended_at(batch: Batch) -> int | None:
    ends = (batch.completed_at, batch.failed_at, batch.expired_at, batch.cancelled_at)
    return next((t for t in ends if t is not None), None)


def render_final(batch: Batch) -> str:
    text = f"batch {batch.id} {batch.status}"
    if counts := batch.request_counts:
        text += f": {counts.completed} succeeded, {counts.failed} failed of {counts.total}"
    if batch.output_file_id or batch.error_file_id:
        text += (
            f"\nresults: sluice batch download {batch.id} -o results.jsonl --errors errors.jsonl"
        )
    return text


def _emit_batch(batch: Batch, as_json: bool, render: Callable[[Batch], str]) -> None:
    if as_json:
        emit_json(batch.model_dump(mode="json"))
    else:
        typer.echo(render(batch))


# -- commands ------------------------------------------------------------------------------


@batch_app.command("submit")
def submit_command(
    file: Annotated[
        Path,
        typer.Argument(
            exists=True,
            dir_okay=False,
            readable=True,
            help="JSONL, one request a line: custom_id, method, url, body.",
        ),
    ],
    endpoint: Annotated[
        str | None,
        typer.Option(help=f"One of {', '.join(ENDPOINTS)}; default: the first line's url."),
    ] = None,
    completion_window: Annotated[str, typer.Option(help="How long the batch may take.")] = "24h",
    metadata: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE attached to the batch; repeatable.")
    ] = None,
    wait_for_end: Annotated[
        bool, typer.Option("--wait", help="Follow it to its end; exit 0 only if it completed.")
    ] = False,
    as_json: JsonFlag = False,
    url: UrlOption = DEFAULT_URL,
    api_key: ApiKeyOption = None,
) -> None:
    """Upload FILE and create a batch of it; print its id."""
    with connected(url, api_key) as client:
        pairs = parse_metadata(metadata or [])
        if not wait_for_end:
            batch = submit(
                client, file, endpoint, completion_window=completion_window, metadata=pairs
            )
            _emit_batch(batch, as_json, lambda b: b.id)
            return
        with ProgressBar() as bar:
            batch = submit_and_wait(
                client,
                file,
                endpoint,
                completion_window=completion_window,
                metadata=pairs,
                on_progress=bar,
            )
    _emit_batch(batch, as_json, render_final)
    raise typer.Exit(exit_code(batch.status))


@batch_app.command("status")
def status_command(
    batch_id: BatchId,
    as_json: JsonFlag = False,
    url: UrlOption = DEFAULT_URL,
    api_key: ApiKeyOption = None,
) -> None:
    """A batch's status, line counts, tokens/s, files and errors."""
    with connected(url, api_key) as client:
        batch = client.batches.retrieve(batch_id)
    _emit_batch(batch, as_json, lambda b: render_status(b, time.time()))


@batch_app.command("list")
def list_command(
    limit: Annotated[int, typer.Option(min=1, max=100, help="Batches on this page.")] = 20,
    after: Annotated[str | None, typer.Option(help="Start after this batch id.")] = None,
    as_json: JsonFlag = False,
    url: UrlOption = DEFAULT_URL,
    api_key: ApiKeyOption = None,
) -> None:
    """Batches, newest first, one page."""
    with connected(url, api_key) as client:
        from openai import omit

        page = client.batches.list(limit=limit, after=after or omit)
    if as_json:
        emit_json(page.model_dump(mode="json"))
        return
    for b in page.data:
        figures = BatchProgress.of(b, time.time())
        typer.echo(
            f"{b.id}  {b.status:<11} {figures.done:>6}/{figures.total:<6} "
            f"{b.endpoint:<20}  {_when(b.created_at)}"
        )
    if page.has_more and page.data:
        typer.echo(f"more: sluice batch list --after {page.data[-1].id}", err=True)


@batch_app.command("cancel")
def cancel_command(
    batch_id: BatchId,
    as_json: JsonFlag = False,
    url: UrlOption = DEFAULT_URL,
    api_key: ApiKeyOption = None,
) -> None:
    """Cancel a batch: lines not yet run are dropped, results so far stay downloadable."""
    with connected(url, api_key) as client:
        batch = client.batches.cancel(batch_id)
    _emit_batch(batch, as_json, lambda b: f"{b.id} {b.status}")


@batch_app.command("download")
def download_command(
    batch_id: BatchId,
    output: Annotated[Path, typer.Option("-o", "--output", help="Write the output file here.")],
    errors: Annotated[
        Path | None, typer.Option(help="Also write the error file (failed lines) here.")
    ] = None,
    as_json: JsonFlag = False,
    url: UrlOption = DEFAULT_URL,
    api_key: ApiKeyOption = None,
) -> None:
    """Write a batch's results (one JSON line per request, by custom_id)."""
    with connected(url, api_key) as client:
        done = download(client, client.batches.retrieve(batch_id), output, errors)
    if as_json:
        emit_json(dataclasses.asdict(done))
        return
    typer.echo(f"wrote {done.output_lines} lines to {done.output}")
    if done.errors is not None:
        typer.echo(f"wrote {done.errors_lines} lines to {done.errors}")
