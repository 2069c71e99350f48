"""Command-line entry points: ``hydrad`` (the daemon and model tools) and ``hydractl`` (operator CLI)."""
