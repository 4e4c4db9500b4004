"""`sluice bulk`: run a Batch API input file at full speed, writing the Batch API's lines.

In-process (the default) it runs `sluice serve`'s embedded stack without HTTP
(`sluice/bulk_run.py`); with `--url` the file runs as a batch on a running Sluice,
through `sluice batch`'s `submit_and_wait` and `download`. The file side (input lines,
resume, the ordered writer, the summary) is `sluice/bulk_files.py`. Those import the
gateway's code, so they are imported when the command runs, not for every `sluice`.

Exit codes: 0 the file is done (line errors are in the output, not a failure); 1 the
remote batch ended otherwise than completed; 2 bad input or options; 130 interrupted
(a rerun with --resume picks up where it stopped).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from sluice import cli_batch
from sluice.cli_common import emit_json, secure_data_dir, settings_or_exit
from sluice.cli_serving import DataDir, Dtype, Model, ServedName
from sluice.settings import EngineWorkerSettings, GatewaySettings

if TYPE_CHECKING:
    from sluice.bulk_files import Done, Summary


class ProgressBar:
    """Lines done of this run, failures, output tokens/s and ETA, on stderr."""

    def __init__(self, total: int) -> None:
        self._progress = Progress(
            TextColumn("bulk"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task = self._progress.add_task("bulk", total=total, detail="loading the engine")

    def __enter__(self) -> ProgressBar:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()

    def __call__(self, summary: Summary) -> None:
        self._progress.update(self._task, completed=summary.done, detail=summary.describe())


def _endpoint(endpoint: str | None, content: bytes) -> str:
    from sluice.bulk_files import first_url

    chosen = endpoint or first_url(content)
    if chosen is None:
        raise cli_batch.BatchInputError('no line names its "url": pass --endpoint')
    return cli_batch.check_endpoint(chosen, "--endpoint" if endpoint else 'the first "url"')


@dataclass(frozen=True, slots=True)
class _Job:
    """The input file and where its lines go: what both modes run."""

    content: bytes
    endpoint: str
    output: Path
    errors: Path | None
    resume: bool
    as_json: bool

    def earlier_runs(self) -> Done:
        """What earlier runs wrote (--resume; torn last lines are cut off first)."""
        from sluice.bulk_files import Done, read_done

        paths = [self.output] + ([self.errors] if self.errors else [])
        return read_done(paths) if self.resume else Done()

    def finish(self, summary: Summary, complete: bool) -> None:
        """Print the summary; an incomplete run exits 130 saying how to resume."""
        if self.as_json:
            emit_json({**summary.as_dict(), "complete": complete})
        elif complete:
            where = f"{self.output} and {self.errors}" if self.errors else str(self.output)
            typer.echo(
                f"{summary.done} lines done ({summary.ok} ok, {summary.failed} failed,"
                f" {summary.skipped} done before) in {summary.seconds:.1f}s,"
                f" {summary.tokens_per_s:,.1f} output tokens/s: {where}"
            )
        if not complete:
            args = [a for a in sys.argv[1:] if a != "--resume"]
            typer.echo(
                f"interrupted: {summary.done + summary.skipped} of {summary.lines} lines written"
                f"\n  resume: {shlex.join(['sluice', *args, '--resume'])}",
                err=True,
            )
            raise typer.Exit(130)


def bulk(
    input_file: Annotated[
        Path,
        typer.Argument(
            exists=True,
            dir_okay=False,
            readable=True,
            help="JSONL in the Batch API's format: custom_id, method, url, body a line.",
        ),
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Write the output lines here.")],
    errors: Annotated[
        Path | None,
        typer.Option(help="Write failed lines here (the Batch API's error file); default: OUTPUT."),
    ] = None,
    endpoint: Annotated[
        str | None,
        typer.Option(help=f"One of {', '.join(cli_batch.ENDPOINTS)}; default: the first url."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Skip the lines OUTPUT (and ERRORS) already hold.")
    ] = False,
    concurrency: Annotated[
        int | None,
        typer.Option(min=1, help="Lines in flight; default: twice the engine's max_num_seqs."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="No progress bar; a summary object on stdout.")
    ] = False,
    model: Model = None,
    served_model_name: ServedName = None,
    dtype: Dtype = None,
    data_dir: DataDir = None,
    url: Annotated[
        str | None,
        typer.Option(help="Run the file as a batch on this running Sluice (its /v1 URL)."),
    ] = None,
    api_key: cli_batch.ApiKeyOption = None,
) -> None:
    """Run every line of INPUT_FILE through the engine in this process at full speed (or,
    with --url, as a batch on a running Sluice); write the Batch API's output lines.

    A line that fails (bad JSON, a duplicate custom_id, a model not served, a body the
    endpoint refuses) gets an error line; it never stops the file. Ctrl-C writes what is
    done and exits 130; rerun with --resume to do the rest.
    """
    content = input_file.read_bytes()
    try:
        chosen = _endpoint(endpoint, content)
    except cli_batch.BatchInputError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    job = _Job(content, chosen, output, errors, resume, as_json)
    if url is not None:
        _bulk_remote(job, url, api_key)
        return
    overrides = {
        "model": model,
        "served_model_name": served_model_name,
        "dtype": dtype,
        "data_dir": data_dir,
        # the progress bar is the narration here: the engine's INFO lines would scroll it
        "log_level": None if "SLUICE_LOG_LEVEL" in os.environ else "WARNING",
    }
    gateway_settings = settings_or_exit(GatewaySettings, **overrides)
    worker_settings = settings_or_exit(EngineWorkerSettings, **overrides)
    secure_data_dir(gateway_settings)  # as `serve`: before a preset is written into it
    _bulk_in_process(job, gateway_settings, worker_settings, concurrency)


def _bulk_in_process(
    job: _Job,
    gateway_settings: GatewaySettings,
    worker_settings: EngineWorkerSettings,
    concurrency: int | None,
) -> None:
    import asyncio

    from sluice import wiring
    from sluice.bulk_files import OrderedWriter, Summary, read_input
    from sluice.bulk_run import default_window, embedded_engine, run_lines
    from sluice.bus.memory import MemoryEventBus

    served = wiring.served_model(gateway_settings)  # the tokenizer only: no engine yet
    lines = read_input(job.content, job.endpoint, {served.name: served})
    done = job.earlier_runs()
    todo = [line for line in lines if not done.has(line)]
    summary = Summary(lines=len(lines), skipped=len(lines) - len(todo))
    window = concurrency or default_window(worker_settings)
    mode = "a" if job.resume else "w"
    complete = True
    try:
        with contextlib.ExitStack() as stack:
            out: IO[str] = stack.enter_context(job.output.open(mode, encoding="utf-8"))
            err = (
                stack.enter_context(job.errors.open(mode, encoding="utf-8")) if job.errors else None
            )
            if todo:
                bar = None if job.as_json else stack.enter_context(ProgressBar(len(todo)))
                bus = MemoryEventBus()
                bus.create_topics(wiring.topic_layout(gateway_settings).specs())
                stack.enter_context(embedded_engine(worker_settings, bus))
                writer = OrderedWriter(out, err)
                complete = asyncio.run(
                    run_lines(
                        bus, gateway_settings, served, job.endpoint, todo, writer, summary,
                        window=window, on_progress=bar,
                    )
                )  # fmt: skip
    except KeyboardInterrupt:  # while the engine loaded, before any line ran
        complete = False
    job.finish(summary, complete)


# -- remote: a batch on a running Sluice -------------------------------------------------------
def _bulk_remote(job: _Job, url: str, api_key: str | None) -> None:
    """The file (less what OUTPUT holds, with --resume) as one batch on the Sluice at
    `url`; its output and error files added to OUTPUT (and ERRORS) once it ended. Unlike
    in-process, a structural fault in a line fails such a batch whole, as OpenAI's do."""
    from sluice.bulk_files import Summary, custom_id_of

    output, errors = job.output, job.errors
    done = job.earlier_runs()
    raws = [raw for raw in job.content.splitlines() if raw.strip()]
    remaining = [raw for raw in raws if custom_id_of(raw) not in done.custom_ids]
    summary = Summary(lines=len(raws), skipped=len(raws) - len(remaining))
    status = "completed"
    with tempfile.TemporaryDirectory(prefix="sluice-bulk-") as tmp:
        part_out, part_err = Path(tmp) / "output.jsonl", Path(tmp) / "errors.jsonl"
        if remaining:
            sent = Path(tmp) / "input.jsonl"
            sent.write_bytes(b"".join(raw + b"\n" for raw in remaining))
            with cli_batch.connected(url, api_key) as client:
                with contextlib.ExitStack() as stack:
                    bar = None if job.as_json else stack.enter_context(cli_batch.ProgressBar())
                    batch = cli_batch.submit_and_wait(client, sent, job.endpoint, on_progress=bar)
                cli_batch.download(client, batch, part_out, part_err)
            status = batch.status
            counts = batch.request_counts
            summary.ok, summary.failed = (counts.completed, counts.failed) if counts else (0, 0)
            summary.output_tokens = batch.usage.output_tokens if batch.usage else 0
        summary.ended_at = time.monotonic()
        mode = "ab" if job.resume else "wb"
        # without --errors, failed lines go to OUTPUT too, after the others
        targets = [(output, part_out), (errors or output, part_err)]
        if errors is not None:
            errors.open(mode).close()
        output.open(mode).close()
        for target, part in targets:
            if part.exists():
                with target.open("ab") as fh:
                    fh.write(part.read_bytes())
    job.finish(summary, True)
    raise typer.Exit(cli_batch.exit_code(status))


def register(app: typer.Typer) -> None:
    app.command()(bulk)
