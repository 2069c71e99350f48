"""``hydrad start --deploy auto``: the planner's pick from a trace, never a reason not to start.

With a trace (``--trace``, else the daemon's own trace folder from earlier runs) holding
enough finished requests of the model being served, the deployment is the one the
planner ranks first for the ``[slo]`` targets on the configured devices. Without one,
or when planning fails for any reason, it is one EPD instance per device, and one log
line says why.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("hydrad.planner")

# Fewer finished requests than this say too little about a workload to plan from.
MIN_REQUESTS = 10
# The newest requests of a long trace are planned from.
MAX_REQUESTS = 2000


def choose_deployment(config, trace_path: str | None = None) -> tuple[str, str]:
    """(deploy spec, why) for ``config`` (a ``DaemonConfig`` with its model path resolved)."""
    from hydrad.cluster.deploy import parse_devices
    from hydrad.cluster.launch import cuda_device_count

    num_cuda = cuda_device_count(config.engine.parallel.devices)
    num_devices = len(parse_devices(config.engine.parallel.devices, num_cuda))
    fallback = f"{num_devices}EPD"
    source = Path(trace_path) if trace_path else config.trace.directory
    model = Path(config.engine.model.path).name
    if num_devices == 1:
        return fallback, "one device: one EPD instance"
    if not trace_path and not source.exists():
        reason = f"one EPD instance per device: no request trace yet in {source}"
        logger.info("deploy auto: %s (%s)", fallback, reason)
        return fallback, reason
    try:
        # Planning reads the trace and the latency models (torch): only once there is a trace.
        from hydrad.planner.profile import Devices, MachineOptions, plan_deployment
        from hydrad.trace import read_trace

        records = read_trace(source, model=model)[-MAX_REQUESTS:]
        if len(records) < MIN_REQUESTS:
            reason = (f"one EPD instance per device: {source} holds {len(records)} finished request(s) of "
                      f"{model}, fewer than {MIN_REQUESTS}")
        else:
            devices = Devices(tuple(parse_devices(config.engine.parallel.devices, num_cuda)))
            options = MachineOptions(router_policy=config.server.router_policy)
            spec, reason = plan_deployment(records, config.engine, devices, options=options)
            logger.info("deploy auto: %s (%s)", spec, reason)
            return spec, reason
    except Exception as e:  # planning must never keep the daemon from starting
        reason = f"one EPD instance per device: planning from {source} failed ({type(e).__name__}: {e})"
        logger.warning("deploy auto: %s", reason)
        return fallback, reason
    logger.info("deploy auto: %s (%s)", fallback, reason)
    return fallback, reason
