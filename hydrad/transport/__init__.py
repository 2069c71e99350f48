"""Typed messages between the daemon and its worker processes (see ``messages``)."""
