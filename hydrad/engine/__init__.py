"""The engine: one instance's requests, scheduler, block managers, model runner."""
