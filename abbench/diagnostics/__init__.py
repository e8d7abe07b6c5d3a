"""Divergence diagnostics: where two arms' outputs part, and why (``abbench diff`` and ``abbench probe``).

* :mod:`~abbench.diagnostics.diff`: pure: two arms' ids of one prompt aligned, the first divergence
  classified; the probe's result (:class:`~abbench.diagnostics.diff.ProbeResult`); their plain-text rendering.
* :mod:`~abbench.diagnostics.layertrace`: pure: two layer traces compared, the first differing layer and
  sub-block, as text, Markdown and a plot.
* :mod:`~abbench.diagnostics.probe`: the forced-continuation probe; launches the arm's service.
* :mod:`~abbench.diagnostics.layers`: the layer probe; launches both arms' services.

The diagnostics sit above the runner (the probes launch services with it); the runner never imports them.
This package imports none of its modules itself, so reading a diff loads no service code.
"""
