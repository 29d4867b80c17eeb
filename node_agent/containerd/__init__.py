"""containerd on the node, derived from ``spec.criConfig``: its config.toml, registry mirrors
(``certs.d``), directories and the environment drop-in of ``containerd.service``.

What is where: ``spec`` (the typed criConfig), ``config`` (the config.toml patch), ``registries``
(hosts.toml and the mirrors' readiness probe), ``expand`` (all of it as items of the OSC),
``images`` (imageRef files, through ``ctr``) and ``ping`` (the health check's call). The package
imports none of them: an apply without a criConfig, and the health check, do not load tomlkit.
"""
