"""``kvgrid router``: an OpenAI-compatible HTTP proxy in front of vLLM pods that routes by ``Score``.

Modules: ``config`` (RouterConfig), ``requests`` (what a request says about routing), ``tokens``
(prompt -> token ids through a pod's ``/tokenize``), ``pods`` (pod -> HTTP base URL), ``upstream``
(forwarding with failover), ``app`` (the aiohttp application), ``cli`` (the command). The ranking
itself is :mod:`kvgrid.client`. See docs/router.md.
"""
