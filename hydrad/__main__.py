"""``python -m hydrad`` is ``hydrad``."""

from hydrad.cli.hydrad_main import main

main()
