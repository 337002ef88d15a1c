"""The ``kvcached demo``: engines sharing one device elastically, against a static split.

``kvcached demo`` (or ``python -m kvcached demo``) starts a few engine-like
processes, each with its own KV pool registered on one device, and serves the
same seeded, bursty traffic twice: once with every pool drawing on one shared
budget, once with the budget split equally. It shows memory per instance live,
prints what happened to the requests in both runs and draws a plot.

Files: ``config`` (the options and the sizes that follow), ``traffic`` (the
schedule), ``engine`` (an engine process), ``fleet`` (the engine processes),
``run`` (orchestration and sampling), ``summary``, ``live``, ``plot`` and
``command`` (the command-line options).
"""
