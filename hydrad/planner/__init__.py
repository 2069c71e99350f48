"""The planner: choose the deployment from the recorded workload and the SLOs.

Modules: ``workload`` (a request trace, ``hydrad.trace``, as simulator requests at a
target rate), ``simulator`` (a discrete-event replay that drives the engine's own
scheduler and block managers and the cluster's router and migration relay on a virtual
clock), ``capacity`` (per-stage
throughput from the latency models: HydraInfer's Algorithm 2 and the bounds that prune
the search), ``search`` (every deployment of N instances, ranked by simulated goodput),
``profile`` (latency models and copy bandwidth on this machine, the whole
``hydractl profile`` run), ``validate`` (top candidates started live and benchmarked),
``auto`` (``hydrad start --deploy auto``'s choice, and the plan it keeps for restarts) and
``replan`` (re-planning while serving).
Imports run downward: engine and cluster code, the bench client's arrival processes and
metrics; never the server or the command line.
"""
