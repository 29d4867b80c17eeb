"""The Kubernetes seam: one client with token reload and timeouts, and a robust list+watch.

Import ``node_agent.kube.client`` only where the API is needed: it loads kubernetes-asyncio,
which costs ~0.7 s and ~40 MB on top of aiohttp. ``node_agent.kube.watch`` is cheap.
"""
