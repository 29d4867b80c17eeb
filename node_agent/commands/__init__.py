"""One-shot jobs of the command line (``cli.py`` is the entry): ``bootstrap`` (install and start
the agent's unit), ``status`` (ask the running agent), ``show_history`` (``status --history``),
``reset`` (take back what the agent put on the node)."""
