"""``hydractl bench``: SLO attainment and goodput of an OpenAI-compatible server."""

from __future__ import annotations

import click

from hydrad.cli.common import console


def _parse_sweep(value: str | None) -> tuple[float, ...]:
    from hydrad.bench import sweep_rates

    parts = value.split(":")
    try:
        start, stop, step = (float(p) for p in parts)
    except ValueError:
        raise click.BadParameter(f"expected R1:R2:STEP, got {value!r}", param_hint="--sweep") from None
    return sweep_rates(start, stop, step)


class _ProgressObserver:
    """One progress bar per rate: finished requests, and how many were sent, met the SLO, or failed."""

    def __init__(self, progress):
        self.progress = progress
        self.task = None

    def run_started(self, label: str, num_requests: int | None) -> None:
        self.task = self.progress.add_task(label, total=num_requests, sent=0, met=0, errors=0)

    def request_sent(self) -> None:
        self.progress.update(self.task, sent=self.progress.tasks[self.task].fields["sent"] + 1)

    def request_finished(self, result) -> None:
        fields = self.progress.tasks[self.task].fields
        errors = fields["errors"] + (result.error is not None)
        self.progress.update(self.task, advance=1, met=fields["met"] + result.met_slo, errors=errors)

    def run_finished(self, run) -> None:
        self.progress.update(
            self.task, description=f"{run.label}  attainment {100 * run.summary.attainment:.1f}%"
        )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def _latency_table(summary):
    from rich.table import Table

    at = f"{summary.concurrency} in flight" if summary.concurrency else f"{summary.rate:.4g} req/s"
    table = Table(title=f"latency at {at} (ms)")
    for column in ("", "p50", "p90", "p99"):
        table.add_column(column, justify="right")
    for name, label in (("ttft", "TTFT"), ("tbt", "TBT"), ("max_gap", "longest gap"), ("e2e", "E2E")):
        table.add_row(label, *(_ms(getattr(summary, f"{name}_p{q}")) for q in (50, 90, 99)))
    table.caption = "longest gap: each request's longest gap between two tokens"
    return table


def _totals_table(result):
    from rich.table import Table

    s = result.summary
    table = Table(show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    table.add_row("requests (met SLO / sent)", f"{s.num_met} / {s.num_requests}")
    table.add_row("SLO attainment", f"{100 * s.attainment:.1f}%")
    table.add_row("throughput", f"{s.throughput_rps:.3g} req/s, {s.output_tokens_per_s:.4g} tok/s")
    if s.goodput_rps is not None:
        unit = "req/s per instance" if result.config.instances > 1 else "req/s"
        table.add_row("goodput", f"{s.goodput_rps:.4g} {unit}")
    table.add_row("errors", str(s.errors))
    return table


def _sweep_table(result):
    from rich.table import Table

    table = Table(title="SLO attainment by request rate")
    for column in ("rate (req/s)", "sent", "attainment", "TTFT p90 (ms)", "TBT p90 (ms)", "req/s", "errors"):
        table.add_column(column, justify="right")
    for run in result.runs:
        s = run.summary
        table.add_row(
            f"{run.rate:.4g}", str(s.num_requests), f"{100 * s.attainment:.1f}%",
            _ms(s.ttft_p90), _ms(s.tbt_p90), f"{s.throughput_rps:.3g}", str(s.errors),
        )
    return table


def _report(result) -> None:
    if result.goodput_total is not None:
        console.print(_sweep_table(result))
    if result.summary is None:
        console.print("no run finished; nothing to report")
        return
    console.print(_latency_table(result.summary))
    console.print(_totals_table(result))
    errors = [r.error for run in result.runs for r in run.results if r.error]
    if errors:
        console.print(f"[yellow]{len(errors)} requests failed; first error:[/] {errors[0]}", highlight=False)
    s = result.summary
    if s.estimated_token_counts:
        console.print(f"[yellow]{s.estimated_token_counts} of {s.num_requests - s.errors} requests: tokens per "
                      "chunk estimated[/] (the server sent neither token ids nor usage per chunk; TBTs of "
                      "chunks that carried several tokens are approximate)", highlight=False)


@click.command("bench")
@click.option("--url", required=True, help="Server root, e.g. http://127.0.0.1:8000.")
@click.option("--model", help="Model name; default: the first one the server lists in /v1/models.")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="Sent as 'Authorization: Bearer KEY'. [env: OPENAI_API_KEY]")
@click.option("--workload", required=True, metavar="SPEC",
              help="textcaps, pope, mme, textvqa, vizwiz, text, mix:NAME=W,..., chat:NAME:TURNS[:WINDOW] (multi-turn "
                   "conversations about one image, WINDOW at a time), or a .jsonl file.")
@click.option("--num-requests", type=click.IntRange(min=1), help="Requests per rate (default 100).")
@click.option("--duration", type=float, help="Send requests for this many seconds per rate instead.")
@click.option("--rate", type=float, help="One run at this many requests per second.")
@click.option("--sweep", metavar="R1:R2:STEP", help="One run per rate from R1 to R2.")
@click.option("--goodput", is_flag=True, help="Search for the goodput by doubling, then bisection.")
@click.option("--concurrency", type=click.IntRange(min=1),
              help="Closed loop: keep C requests in flight, each sent when one finishes (peak throughput).")
@click.option("--warmup", type=click.IntRange(min=0), default=0, show_default=True,
              help="Requests run first and not counted: with --concurrency the same way, else at the first rate.")
@click.option("--search-start", type=float, default=1.0, show_default=True, help="First rate of --goodput.")
@click.option("--search-tol", type=float, default=0.05, show_default=True,
              help="--goodput stops when its bracket is this narrow, relative to the rate.")
@click.option("--arrivals", type=click.Choice(["poisson", "trace"]),
              help="Default: trace with --trace, else poisson. 'trace' alone uses the JSONL workload's timestamps.")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Mooncake-format trace whose timestamps give the arrivals.")
@click.option("--slo-ttft", type=float, required=True, help="TTFT SLO in seconds.")
@click.option("--slo-tbt", type=float, required=True, help="SLO on each request's p90 inter-token gap, in seconds.")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs behind the URL; goodput is reported per instance.")
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.0, show_default=True,
              help="Sampling temperature of every request (0: greedy).")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), help="Nucleus sampling of every request.")
@click.option("--top-k", type=click.IntRange(min=1), help="Top-k sampling of every request.")
@click.option("--response-format", metavar="SPEC",
              help="Structured outputs of every request: json_object, or json_schema:FILE (a JSON schema).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--image-format", type=click.Choice(["jpeg", "png"]), default="jpeg", show_default=True)
@click.option("--api", type=click.Choice(["chat", "responses"]), default="chat", show_default=True,
              help="Send the requests to /v1/chat/completions, or to OpenAI's Responses API (/v1/responses).")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds of silence after which a request counts as failed.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the results as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write SLO attainment against rate as a PNG.")
def bench(url, model, api_key, workload, num_requests, duration, rate, sweep, goodput, concurrency, warmup,
          search_start, search_tol, arrivals, trace, slo_ttft, slo_tbt, instances, temperature, top_p, top_k,
          response_format, seed, image_format, api, timeout, out, plot) -> None:
    """Measure TTFT, TBT, SLO attainment and goodput of an OpenAI-compatible server."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hydrad.bench import SLO, BenchConfig, GoodputSearch, Sampling, run_bench
    from hydrad.bench.config import response_format_of
    from hydrad.bench.plot import plot_attainment

    if sum((rate is not None, sweep is not None, goodput, concurrency is not None)) != 1:
        raise click.UsageError("give exactly one of --rate, --sweep, --goodput and --concurrency")
    config = BenchConfig(
        url=url,
        slo=SLO(ttft=slo_ttft, tbt=slo_tbt),
        workload=workload,
        model=model,
        api_key=api_key,
        num_requests=num_requests,
        duration=duration,
        rates=(rate,) if rate is not None else _parse_sweep(sweep) if sweep is not None else (),
        search=GoodputSearch(start_rate=search_start, rel_tol=search_tol) if goodput else None,
        concurrency=concurrency,
        warmup=warmup,
        sampling=Sampling(temperature, top_p, top_k,
                          response_format_of(response_format) if response_format is not None else None),
        arrivals=arrivals or ("trace" if trace else "poisson"),
        trace=trace,
        instances=instances,
        seed=seed,
        image_format=image_format,
        request_timeout=timeout,
        api=api,
    )
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("sent {task.fields[sent]}  met {task.fields[met]}  errors {task.fields[errors]}"),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        result = run_bench(config, _ProgressObserver(progress))
    if result.interrupted:
        console.print("[yellow]interrupted:[/] the results cover the requests that finished")
    if out:
        with open(out, "w") as f:
            f.write(result.to_json())
    if plot and result.runs:
        plot_attainment(result, plot)
    _report(result)
    if out:
        console.print(f"results written to {out}")
    if result.interrupted:
        raise click.exceptions.Exit(130)
