"""The daemon helpers of the server tests start the daemons of the planner's end-to-end test."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
