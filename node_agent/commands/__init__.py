"""The command line's jobs, on top of every other layer (``cli.py`` is the entry): ``bootstrap``
(install and start the agent's unit), ``status`` (ask the running agent), ``show_history``
(``status --history``), ``reset`` (take back what the agent put on the node), ``fleet`` (the
pools of a cluster as their agents report them)."""
