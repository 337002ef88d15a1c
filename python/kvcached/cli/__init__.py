"""kvcached's command-line tools and what they share.

``main`` is the ``kvcached`` command (``info``, ``demo``, ``serve``; also ``python -m kvcached``),
``kvctl`` (with ``kvctl_steer`` and ``kvctl_output``) inspects and steers the instances of a device,
``kvtop`` shows them live; ``support`` holds what every tool does alike (one-line errors,
``--version``, settings checked up front) and ``widgets`` the terminal pieces kvtop and the demo
both draw. This package imports none of them, so a library module may use ``support`` or
``widgets`` without loading a command.
"""
