"""``hydrad start``: run the daemon (workers + HTTP API) in the foreground."""

from __future__ import annotations

import click


@click.command()
@click.option("--model", "model_path", metavar="PATH", help="Checkpoint folder (default: the built-in model).")
@click.option("--config", "config_file", metavar="FILE", envvar="HYDRAD_CONFIG", type=click.Path(dir_okay=False),
              help="TOML config file (see etc/hydrad.toml); flags override it. Env: HYDRAD_CONFIG.")
@click.option("--devices", metavar="SPEC", help="cpu:N, cuda:0,1 or auto (every GPU, else CPU workers: one, or "
              "as many as --deploy auto's plan picks).")
@click.option("--deploy", metavar="SPEC", help="Instances and roles, e.g. 2EPD; auto: the planner's choice from a "
              "request trace, else one EPD per device.")
@click.option("--trace", "trace_path", metavar="FILE", type=click.Path(exists=True),
              help="With --deploy auto: plan from this request trace (file or folder) instead of the daemon's own.")
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="Port to listen on (default 8000).")
@click.option("--api-key", envvar="HYDRAD_API_KEY", help="Require this bearer key on /v1/*. Env: HYDRAD_API_KEY.")
@click.option("--admin-token", envvar="HYDRAD_ADMIN_TOKEN",
              help="Token opening /admin/* to non-loopback clients. Env: HYDRAD_ADMIN_TOKEN.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--frontend-processes", type=click.IntRange(min=1), metavar="N",
              help="HTTP processes serving the port (default 1; [server] frontend_processes).")
def start(model_path, config_file, devices, deploy, host, port, api_key, admin_token, log_level, trace_path,
          frontend_processes) -> None:
    """Start the daemon: one worker per device, then the OpenAI-compatible API."""
    import asyncio
    import dataclasses
    import logging
    import os

    from hydrad.cli.common import console
    from hydrad.config_file import load_config
    from hydrad.engine.cores import usable_cpus
    from hydrad.logs import configure_logging

    flags = {
        "model.path": model_path, "parallel.devices": devices, "parallel.deploy": deploy,
        "server.host": host, "server.port": port, "server.api_key": api_key,
        "server.admin_token": admin_token, "server.log_level": log_level,
        "server.frontend_processes": frontend_processes,
    }
    config = load_config(config_file, {k: v for k, v in flags.items() if v is not None})
    os.environ["HYDRAD_LOG_LEVEL"] = config.server.log_level  # workers read it
    configure_logging(config.server.log_level, config.server.log_requests)

    from hydrad.cluster.deploy import plan_instances
    from hydrad.cluster.launch import cuda_device_count, launch_all, migrates, plan_specs, stop_unadopted
    from hydrad.cluster.preflight import check_listen, check_memory, check_shared_memory
    from hydrad.models.default import resolve_model_path

    # Resolved once here, so workers never race to build the default model.
    model = dataclasses.replace(config.engine.model, path=str(resolve_model_path(config.engine.model.path)))
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, model=model))
    deployment = None
    if config.engine.parallel.deploy.strip().lower() == "auto":
        from hydrad.planner.auto import choose_deployment

        choice = choose_deployment(config, trace_path)
        deployment = {"spec": choice.deploy, "reason": choice.reason, "auto": True,
                      "planned_devices": config.engine.parallel.devices, "refresh_since": choice.refresh_since}
        parallel = dataclasses.replace(config.engine.parallel, deploy=choice.deploy, devices=choice.devices)
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, parallel=parallel))
    parallel = config.engine.parallel
    specs = plan_specs(plan_instances(parallel.deploy, parallel.devices, cuda_device_count(parallel.devices)))
    if any(spec.device == "cpu" for spec in specs) and (usable := usable_cpus()) < (os.cpu_count() or 1):
        logging.getLogger("hydrad.daemon").info(
            "CPU workers share %d of the host's %d CPUs (the CPUs this process may run on, within its cgroup's "
            "CPU quota)", usable, os.cpu_count())
    check_listen(config.server.host, config.server.port)  # in a second, not after the workers load
    check_shared_memory(config.engine.cache, [spec.device for spec in specs], migrates(specs))
    check_memory(config.engine, [spec.device for spec in specs], config.engine.model.path)
    # The workers load (torch, weights, caches) while this process imports the daemon's stack.
    launched = launch_all(config.engine, specs)
    try:
        from hydrad.server.daemon import serve

        try:
            from uvloop import run
        except ImportError:  # uvloop is not built for every platform
            run = asyncio.run
        run(serve(config, specs, console, deployment, launched))
    finally:
        stop_unadopted(launched)  # only those the daemon failed before taking over
