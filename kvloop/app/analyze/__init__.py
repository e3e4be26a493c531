"""``kvloop analyze``: will the return path pay on this traffic? Prefix shares, retention through the broker's real
core, interconnect bytes, predicted TTFT and a verdict, from the router's per-turn records
(:mod:`kvloop.router.records`) or from OpenAI-style conversations.

Pure modules take the records and every figure (time included) as arguments: :mod:`.shape`, :mod:`.retention`,
:mod:`.costs`, :mod:`.verdict`. :mod:`.load` reads files, :mod:`.report` writes Markdown and PNGs, :mod:`.main` is
the command. See ``docs/analyze.md``.
"""
