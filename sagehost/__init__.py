"""The host: what wires the apps into one program.

The top layer. It imports every app (`agents`, `scheduling`, `pooling`) and the kernel
(`sageproject`); nothing imports it back (the import-linter contract in
``pyproject.toml``). It holds the URL configuration (`urls`, `api_urls`), the ASGI and
WSGI entry points (`asgi`, `wsgi`), the web process's handler and express lane
(`handler`, `express`), the web processes' supervisor (`webserver`), the admin site with
its capacity page (`admin`), ``/healthz`` and ``/readyz`` (`views`, `health`),
``GET /metrics`` (`metrics`), and the commands ``runhost``, ``runweb`` and ``doctor``.
"""
