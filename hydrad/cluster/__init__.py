"""The control plane: deployment specs, the router, the request table and migration
relay, the supervisor of worker processes, and the in-process and multi-process
clusters that ``hydrad.LLM`` and the daemon drive. Imports run downward only: this
package uses the engine and the transport, never the server."""
