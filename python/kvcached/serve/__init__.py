"""``kvcached serve``: several models on one device behind one OpenAI-compatible endpoint.

One job per module: :mod:`~kvcached.serve.config` (the YAML schema, checked whole first, into
the values of :mod:`~kvcached.serve.spec`), :mod:`~kvcached.serve.config_limits` (bounds that
keep any file's check quick and small), :mod:`~kvcached.serve.owned_arguments` (engine arguments
serve sets itself, in every spelling), :mod:`~kvcached.serve.machine_checks` and
:mod:`~kvcached.serve.python_probe` (the machine: log directory, model paths, each engine's
Python), :mod:`~kvcached.serve.engines` (each engine's command line, environment and readiness
check), :mod:`~kvcached.serve.processes` (process groups), :mod:`~kvcached.serve.supervisor`
(start, watch, restart), :mod:`~kvcached.serve.engine_logs` (each engine's log file),
:mod:`~kvcached.serve.memory` (the device registry per model), :mod:`~kvcached.serve.router`
(the endpoint), :mod:`~kvcached.serve.metrics` and :mod:`~kvcached.serve.handover`
(``/metrics``), :mod:`~kvcached.serve.progress` (the start-up view), :mod:`~kvcached.serve.server`
(one run) and :mod:`~kvcached.serve.command` (the CLI).
Needs the ``serve`` extra (``pip install ".[serve]"`` in a kvcached clone); ``docs/serve.md`` describes it.
"""
