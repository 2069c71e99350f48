"""``hydractl redeploy``: change a running daemon's deployment without losing a request."""

from __future__ import annotations

import click


@click.command()
@click.option("--deploy", "spec", required=True, metavar="SPEC",
              help="The new deployment on the same devices, e.g. 1EP+1D or 1E+1P+1D.")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, envvar="HYDRAD_URL",
              help="The daemon's base URL. Env: HYDRAD_URL.")
@click.option("--admin-token", envvar="HYDRAD_ADMIN_TOKEN", help="Needed for non-loopback daemons. "
              "Env: HYDRAD_ADMIN_TOKEN.")
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds to wait for the change.")
def redeploy(spec: str, url: str, admin_token: str | None, timeout: float) -> None:
    """Change the instances' roles while the daemon serves.

    Instances that gain stages load what those need while serving their old ones; then
    every instance hands the requests of the stages it loses to the others, through the
    normal migration path, and drops them. No request is lost or fails.
    """
    from hydrad.cli.common import console

    with console.status(f"redeploying as {spec}", spinner="dots") as status:
        result = None
        for line in post_lines(url, "/admin/redeploy", {"deploy": spec}, admin_token, timeout):
            if "progress" in line:
                console.print(f"  {line['progress']}", highlight=False)
                status.update(f"redeploying as {spec}: {line['progress']}")
            elif "error" in line:
                raise click.ClickException(line["error"]["message"])
            else:
                result = line
    if result is None:
        raise click.ClickException("the daemon ended the answer before the redeploy finished")
    if not result.get("changed", True):
        console.print(f"already serving as [bold]{result['deploy']}[/]: nothing to change", highlight=False)
    else:
        console.print(f"serving as [bold]{result['deploy']}[/] after {result['seconds']:.1f} s", highlight=False)


def post_lines(url: str, path: str, body: dict, admin_token: str | None, timeout: float):
    """POST ``body`` to ``url`` + ``path`` and yield the JSON object of every line of the answer as it comes."""
    import json

    from hydrad.cli.daemon_http import daemon_request

    with daemon_request(url, path, admin_token, body=body, timeout=timeout) as response:
        for raw in response:
            if raw.strip():
                yield json.loads(raw)
