"""The read side: how the running agent is seen, never changed.

``view`` reads every part into one typed snapshot; ``unix_socket`` serves it to ``node-agent
status``; ``http_ports`` serves the health probes (``probes``) and ``/metrics`` (``metrics``);
``readside`` starts and stops both; ``observations`` counts applies as they happen."""
